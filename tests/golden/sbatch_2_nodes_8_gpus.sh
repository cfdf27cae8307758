#!/bin/bash

# Parameters
#SBATCH --account=llm
#SBATCH --constraint=h100
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=titan_exp:llama3_8b-fsdp2-tp8
#SBATCH --mem=480GB
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=<job_dir>/slurm/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=high
#SBATCH --signal=USR2@300
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
module load cuda/12.4
source .venv/bin/activate
export MASTER_PORT=${MASTER_PORT:-$(<python> -m launchers.rendezvous)}

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output <job_dir>/slurm/%j_%t_log.out --cpu-bind=none bash -c 'trap "" USR2; exec "$@"' -- <python> -u -m submitit.core._submit <job_dir>/slurm
