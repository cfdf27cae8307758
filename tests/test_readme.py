"""Every command of the README, as written, on this machine (2 cores), in a fresh working folder and
in the README's order (`compare` reads the sweep before it). A command that needs more than this
machine says so in its comment, `(needs: ...)`, and is not run; a Hugging Face folder, a tokenizer
and documents stand where the README names the user's (`M=...`, `Q=...`, `corpus/`, `more/`)."""

import os
import re
import signal
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from titan_exp.data.text import train_tokenizer

from conftest import REPO, processes_naming, stopped_for_good

NEEDS = "(needs: "
# Commands run elsewhere, by what runs them.
RUN_ELSEWHERE = {
    "./setup.sh --test && python -m ruff check": "the test command itself (.ci/run)",
    "titan_exp experiment=loss_parity": "tests/test_parity.py (marked slow), as a user runs it",
}
SETUP = "./setup.sh && "  # done: this test runs after it


def readme_commands() -> list[tuple[str, str]]:
    """(command, its comment) for each command of the README's bash blocks, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            command, *comment = re.split(r"\s+#\s", line, maxsplit=1)
            commands.append((command.strip(), "".join(comment).strip()))
    return commands


def user_files(folder: Path) -> dict[str, str]:
    """What the README's Hugging Face block names: a Llama folder and a Qwen3-MoE one (4 experts)
    with their tokenizer, and documents. Returns the folders by the README's names for them."""
    docs = [f"Doc {i}: " + " ".join(["the quick brown fox jumps over the lazy dog"] * (i % 7 + 1)) for i in range(200)]
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=2048)  # fmt: skip
    llama, moe = folder / "models" / "Llama-tiny", folder / "models" / "Qwen3-MoE-tiny"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, intermediate_size=160)).save_pretrained(llama)
    moe_config = transformers.Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    transformers.Qwen3MoeForCausalLM(moe_config).save_pretrained(moe)
    for model in (llama, moe):
        (model / "tokenizer.json").write_text(train_tokenizer(docs, 300).to_str())
    (folder / "corpus").mkdir()
    (folder / "corpus" / "docs.jsonl").write_text("".join(f'{{"text": "{doc}"}}\n' for doc in docs))
    (folder / "more").mkdir()
    pq.write_table(pa.table({"text": docs}), folder / "more" / "docs.parquet")
    return {"M": str(llama), "Q": str(moe)}


@pytest.mark.slow  # every command the README shows: about 4 minutes on 2 cores
def test_every_readme_command_runs_as_written_or_says_what_it_needs(tmp_path):
    commands = readme_commands()
    assert len(commands) > 15 and all(command for command, _ in commands)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **user_files(tmp_path)}
    ran = []
    for command, comment in commands:
        if NEEDS in comment or command.startswith(tuple(RUN_ELSEWHERE)):
            continue
        if re.fullmatch(r"[MQ]=\S+", command):  # the user's model folders: ours, in env
            continue
        command = command.removeprefix(SETUP)
        if command == "titan_exp ui":
            _stops_on_ctrl_c(command, tmp_path, env)
        else:
            done = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
            )
            assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        ran.append(command)
    # The main use, each run here: a job, a sweep, a plan, the comparison, the UI, your own weights.
    assert {
        "python -m titan_exp",
        "titan_exp -m parallelism.tensor_parallel_degree=1,2 training.steps=20",
        "titan_exp compare",
    } <= set(ran)
    own = [command for command in ran if command.startswith("titan_exp model=hf")]
    assert any("expert_parallel_degree=2" in command for command in own) and len(ran) >= 16, ran


def _stops_on_ctrl_c(command: str, folder: Path, env: dict) -> None:
    """A server: up until its links are printed, then Ctrl-C ends it with status 0."""
    ui = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=folder, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    with stopped_for_good(ui, lambda ui: os.killpg(ui.pid, signal.SIGINT)):
        said = ""
        while "as charts: " not in said:
            line = ui.stdout.readline()
            assert line, f"{command} ended before its links: {said[-2000:]}"
            said += line
        # MLflow's job runner, whose tasks run in sessions of their own beyond a Ctrl-C's reach, is off.
        assert not processes_naming("huey_consumer"), said
    assert ui.returncode == 0
