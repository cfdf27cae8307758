"""Checkpoints from untrusted hands and saves onto a full disk, in one process (DCP needs no process
group): a planted pickle payload is refused without running, a genuine checkpoint still loads, a
save that fails leaves no partial folder, and one the disk cannot hold is refused before writing."""

import errno
import os
import pickle
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from titan_exp.checkpoint.config import CheckpointConfig
from titan_exp.checkpoint.errors import UntrustedCheckpointError
from titan_exp.checkpoint.hf_export import ExportSources
from titan_exp.checkpoint.layout import NotEnoughSpaceError, check_free_space, step_dir
from titan_exp.checkpoint.manager import TrainCheckpointer, load_model, save_model
from titan_exp.checkpoint.model_record import TrainedAs, TrainingRecord
from titan_exp.dependency_warnings import ignore_unavoidable_warnings
from titan_exp.models.config import ModelConfig
from titan_exp.optim.config import LRSchedulerConfig
from titan_exp.optim.optimizer import Optimizers

# Saved and loaded in one process, as a seed checkpoint is: DCP's warning about it is ours to ignore
# (titan_exp/dependency_warnings.py), any other is an error.
pytestmark = pytest.mark.filterwarnings("error")
REFUSED = "which a DCP checkpoint never does; refusing to load it (a checkpoint from someone else is not trusted)"


class Payload:
    """What an attacker pickles: unpickling it calls `call(*args)`."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def checkpointer(folder: Path, seed: int) -> TrainCheckpointer:
    """A model trained one step, with its optimizer and LR schedule."""
    net = model(seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    net(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    trained_as = TrainedAs(tokens_per_step=12, steps=1, lr=1e-3, lr_scheduler=LRSchedulerConfig())
    return TrainCheckpointer(
        CheckpointConfig(enable=True, folder=str(folder)), [net], Optimizers([optimizer], [scheduler]), ModelConfig(),
        TrainingRecord(trained_as, ExportSources(None, None)),
    )  # fmt: skip


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_a_genuine_seed_checkpoint_loads(tmp_path: Path) -> None:
    saved, loaded = model(0), model(1)
    load_model(loaded, str(save_model(saved, str(tmp_path), ModelConfig())))
    assert_same_weights(saved, loaded)


def test_a_genuine_training_checkpoint_resumes_and_gives_its_weights(tmp_path: Path) -> None:
    saved = checkpointer(tmp_path, 0)
    saved.save(7, is_writer=True)
    resumed = checkpointer(tmp_path, 1)
    assert resumed.resume() == 7
    assert_same_weights(saved.parts[0], resumed.parts[0])
    assert resumed.schedulers[0].state_dict() == saved.schedulers[0].state_dict()
    assert resumed.optimizers[0].param_groups[0]["lr"] == saved.optimizers[0].param_groups[0]["lr"]
    weights = model(2)
    load_model(weights, str(step_dir(str(tmp_path), 7)))
    assert_same_weights(saved.parts[0], weights)


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec"])
def test_a_payload_in_metadata_is_refused_without_running(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "MARKER"
    payload = Payload(os.system, f"touch {marker}")
    if kind == "builtins.exec":
        payload = Payload(exec, f"open({str(marker)!r}, 'w').close()")
    folder = save_model(model(0), str(tmp_path / "ckpt"), ModelConfig())
    (folder / ".metadata").write_bytes(pickle.dumps(payload))
    refused = f"{'posix.system' if kind == 'os.system' else kind}, {REFUSED}"
    with pytest.raises(UntrustedCheckpointError) as err:
        load_model(model(1), str(folder))
    assert str(err.value) == f"checkpoint {folder}/.metadata refers to {refused}"
    with pytest.raises(UntrustedCheckpointError):  # resuming: not passed over for an older checkpoint
        checkpointer(tmp_path / "ckpt", 1).resume()
    assert not marker.exists()


def test_a_payload_among_the_values_is_refused_without_running(tmp_path: Path) -> None:
    """.metadata genuine, the LR schedule's state in the .distcp file a pickle payload."""
    marker = tmp_path / "MARKER"
    planted = checkpointer(tmp_path, 0)
    state = planted._merged(planted._part_states(), 7)
    state["lr_scheduler"]["last_epoch"] = Payload(os.system, f"touch {marker}")
    ignore_unavoidable_warnings()  # DCP's about a save in one process, as our own save_whole does
    dcp.save(state, checkpoint_id=str(step_dir(str(tmp_path), 7)))
    with pytest.raises(UntrustedCheckpointError) as err:
        checkpointer(tmp_path, 1).resume()
    where = f"checkpoint {step_dir(str(tmp_path), 7)}: lr_scheduler.last_epoch"
    assert str(err.value) == f"{where} refers to posix.system, {REFUSED}"
    assert not marker.exists()


def test_what_is_no_checkpoint_is_still_said_to_be_unreadable(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=f"^{tmp_path} is not a readable checkpoint: UnpicklingError"):
        load_model(model(0), str(tmp_path))


def test_a_save_that_fails_midway_leaves_no_partial_folder(tmp_path: Path, monkeypatch) -> None:
    saver = checkpointer(tmp_path, 0)
    saver.save(5, is_writer=True)
    write_data = FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        write_data(self, plan, planner).wait()  # the shard files are there when the disk runs out
        assert any(Path(self.path).glob("*.distcp"))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    with pytest.raises(CheckpointException, match="No space left on device"):
        saver.save(10, is_writer=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]


def test_a_save_the_disk_cannot_hold_is_refused_before_writing(tmp_path: Path, monkeypatch) -> None:
    saver = checkpointer(tmp_path, 0)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    monkeypatch.setattr(FileSystemWriter, "write_data", lambda *args: pytest.fail("wrote"))
    with pytest.raises(NotEnoughSpaceError) as err:
        saver.save(5, is_writer=True)
    said = str(err.value)
    assert said.startswith(f"checkpoint folder {tmp_path} needs 0.00 GiB (") and "\n" not in said
    assert said.endswith(
        "but its disk has 0.00 GiB (1000 bytes) free; free some space or point checkpoint.folder elsewhere"
    )
    assert list(tmp_path.iterdir()) == []


def test_free_space_is_checked_on_the_nearest_folder_there_is(tmp_path: Path, monkeypatch) -> None:
    """As the pre-flight may ask: a folder not made yet."""
    asked = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: asked.append(path) or SimpleNamespace(free=4))
    check_free_space(str(tmp_path / "new" / "ckpt"), 4)
    with pytest.raises(NotEnoughSpaceError, match=r"needs 0.00 GiB \(5 bytes\) .* has 0.00 GiB \(4 bytes\) free"):
        check_free_space(str(tmp_path / "new" / "ckpt"), 5)
    assert asked == [tmp_path, tmp_path]


# Issue 68: a checkpoint folder others can write in (a shared file system), and a full disk during
# the Hugging Face export.


def victim_folder(tmp_path: Path) -> Path:
    """Someone's folder, with a file the job's user may write, which a link planted among the
    checkpoints points at."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("kept")
    return victim


def assert_untouched(victim: Path) -> None:
    assert sorted(p.name for p in victim.iterdir()) == ["precious"] and (victim / "precious").read_text() == "kept"


def test_a_save_never_writes_through_a_link_planted_as_its_folder_or_in_it(tmp_path: Path) -> None:
    """step-3.saving a link to another folder (the save wrote the whole checkpoint there), and a
    folder step-4.saving of someone's whose model.json and shard are links to their files (the save
    wrote over them): each is refused in one line naming it, and nothing is written there."""
    victim, ck = victim_folder(tmp_path), tmp_path / "ck"
    ck.mkdir()
    (ck / "step-3.saving").symlink_to(victim)
    planted = ck / "step-4.saving"
    planted.mkdir()
    for name in ("model.json", "__0_0.distcp"):
        (planted / name).symlink_to(victim / "precious")
    saver = checkpointer(ck, 0)
    with pytest.raises(ValueError) as refused:
        saver.save(3, is_writer=True)
    said = f"{ck}/step-3.saving is a link to {victim} that no save of this project left; remove it"
    assert str(refused.value) == said
    with pytest.raises(ValueError, match=f"^{planted} is a folder that no save of this project left; remove it$"):
        saver.save(4, is_writer=True)
    assert_untouched(victim)
    assert sorted(p.name for p in ck.iterdir()) == ["step-3.saving", "step-4.saving"]


def test_a_step_folder_that_is_a_link_is_neither_replaced_nor_pruned(tmp_path: Path) -> None:
    """step-3 a link to /etc made a save of step 3 call rmtree on it; a linked step-1 among those
    keep_latest_k prunes is no checkpoint of the folder's, and stays as it is."""
    victim, ck = victim_folder(tmp_path), tmp_path / "ck"
    (victim / ".metadata").write_bytes(b"")
    ck.mkdir()
    (ck / "step-3").symlink_to(victim)
    (ck / "step-1").symlink_to(victim)
    saver = checkpointer(ck, 0)
    with pytest.raises(ValueError, match=f"^{ck}/step-3 is no step folder a save wrote \\(a link or a file\\); remove"):
        saver.save(3, is_writer=True)
    saver.cfg.keep_latest_k = 1
    saver.save(5, is_writer=True)
    saver.save(6, is_writer=True)
    assert sorted(p.name for p in ck.iterdir()) == ["step-1", "step-3", "step-6"]
    (victim / ".metadata").unlink()
    assert_untouched(victim)


def test_a_leftover_of_a_save_is_removed_and_the_save_goes_on(tmp_path: Path) -> None:
    from titan_exp.checkpoint.staging import MARK, make_fresh

    make_fresh(tmp_path / "step-3.saving")  # as a save killed outright leaves it
    (tmp_path / "step-3.saving" / "__0_0.distcp").write_bytes(b"cut short")
    checkpointer(tmp_path, 0).save(3, is_writer=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
    assert not (tmp_path / "step-3" / MARK).exists() and checkpointer(tmp_path, 1).resume() == 3


def test_a_record_is_never_written_through_a_link(tmp_path: Path) -> None:
    from titan_exp.checkpoint.model_record import write_model_record

    victim = victim_folder(tmp_path)
    (tmp_path / "model.json").symlink_to(victim / "precious")
    with pytest.raises(FileExistsError):
        write_model_record(tmp_path, ModelConfig(), False)
    assert_untouched(victim)


def test_a_metadata_that_is_a_fifo_or_names_a_file_elsewhere_is_refused_without_waiting(tmp_path: Path) -> None:
    """A FIFO .metadata blocked a rank for ever; a .metadata whose shard lies outside its folder
    would have DCP read it. Both refused before DCP opens anything."""
    import signal

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    folder = save_model(model(0), str(tmp_path / "ckpt"), ModelConfig())
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own save: trusted here
    (folder / ".metadata").rename(tmp_path / "saved_metadata")
    os.mkfifo(folder / ".metadata")

    def waited(*_) -> None:
        raise TimeoutError("the reader waited on the FIFO")

    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(30)
    try:
        with pytest.raises(ValueError, match=f"^{folder} is not a readable checkpoint: .*metadata is a FIFO, not a"):
            load_model(model(1), str(folder))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    (folder / ".metadata").unlink()
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo("../elsewhere.distcp", info.offset, info.length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UntrustedCheckpointError, match="names '../elsewhere.distcp' as a file of its folder; refusing"):
        load_model(model(1), str(folder))


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs of its own (root only): a disk that really fills; resize(n) sets its size in bytes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", disk]).returncode:
        pytest.skip("a full disk is a small tmpfs here, which only root may mount")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", disk], check=True)

    yield disk, resize
    subprocess.run(["umount", disk], check=True)


def test_a_full_disk_during_the_export_keeps_the_checkpoint_it_exports_and_the_one_before(small_disk) -> None:
    """The export of the last step fails for want of space (its DCP checkpoint fitted): what the
    export wrote goes, the step's checkpoint stays complete (a resume goes on from it), and so does
    the one before. The probe's run ended with none."""
    from titan_exp.checkpoint.layout import complete_steps, folder_bytes
    from titan_exp.models.registry import build_model

    disk, resize = small_disk
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16)

    def trained(seed: int) -> TrainCheckpointer:
        torch.manual_seed(seed)
        net = build_model(cfg)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        net(torch.randint(0, cfg.vocab_size, (2, 16))).sum().backward()
        optimizer.step()
        trained_as = TrainedAs(tokens_per_step=32, steps=10, lr=1e-3, lr_scheduler=LRSchedulerConfig())
        section = CheckpointConfig(enable=True, folder=str(disk), last_save_in_hf=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        record = TrainingRecord(trained_as, ExportSources(None, None))
        return TrainCheckpointer(section, [net], Optimizers([optimizer], [scheduler]), cfg, record)

    saver = trained(0)
    saver.save(5, is_writer=True)
    # The export writes its weights twice (each rank's slices, then whole tensors): room for them
    # once, beside step 10's DCP files (the space check allows for ~1 MB more than DCP writes).
    weights = sum(p.numel() * 4 for p in saver.parts[0].parameters())
    resize(2 * folder_bytes(disk / "step-5") + weights * 5 // 4)
    with pytest.raises(CheckpointException, match="No space left on device"):
        saver.save(10, is_writer=True, last=True)
    assert complete_steps(str(disk)) == [5, 10]
    assert sorted(p.name for p in disk.iterdir()) == ["step-10", "step-5"]
    assert not list((disk / "step-10").glob("*.safetensors"))
    resumed = trained(1)
    assert resumed.resume() == 10
    assert_same_weights(saver.parts[0], resumed.parts[0])
