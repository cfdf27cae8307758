"""Analytic estimates from a layout's shape alone (torch-free): one rank's peak memory and step
time, and the device profiles (`hardware`) and planning options (`plan`) they are made for. The
pre-flight check (config/) and the planner (plan/) build on them."""
