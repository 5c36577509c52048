"""A user's mistake ends every command with one `error: ...` line and exit status 2, no traceback; only
trainer/errors.py prints that line (no command re-implements it).

For `python -m trainer.train`, the cheap cases (errors found before any DataLoader starts) run through the
real `cli()` one after another in ONE subprocess (a Python start costs ~2 s); errors raised in a DataLoader
worker, the HYDRA_FULL_ERROR=1 escape hatch and torchrun each get a real `python -m trainer.train` of their
own.
"""

from __future__ import annotations

import ast
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from torch._utils import ExceptionWrapper

from tests.harness import free_port
from tests.helpers import ENV, LAYERS, ROOT, SMALL, TRAIN_CLI_DRIVER, assert_one_error_line
from trainer.data.reader import DataStreamError
from trainer.data.shards import PrepareError
from trainer.errors import EXIT_USER_ERROR, UserError, command, one_line, original_message, run_command
from trainer.inspect_mask import InspectError
from trainer.model import BackendUnavailable, resolve_backend
from trainer.reporting.runs import ReportError


def train_cli(run_dir: Path, data: Path, *overrides: str,
              env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={data}", f"hydra.run.dir={run_dir}", *SMALL,
           *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------------------------------------
# Data directories with one thing wrong each
# ---------------------------------------------------------------------------------------------


def copy_of(demo_data: Path, dest: Path) -> Path:
    shutil.copytree(demo_data, dest)
    return dest


def rewrite_train_shards(data: Path, rewrite) -> None:
    for shard in sorted(data.glob("train-*.tar")):
        rewrite(shard)


def truncate(shard: Path) -> None:
    """Cut the shard inside the fourth member's data: a tar whose end is missing."""
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[3].offset_data + 1
    shard.write_bytes(shard.read_bytes()[:cut])


def symlink_second_sample(shard: Path) -> None:
    """Keep the first 5 samples, the second one's text turned into a symlink to the first's (its other
    members, the stored ids, dropped: nothing of it is left that webdataset reads)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    keys = list(dict.fromkeys(m.name.split(".")[0] for m, _ in members))[:5]
    with tarfile.open(shard, "w") as tar:
        for member, data in members:
            key = member.name.split(".")[0]
            if key == keys[1] and member.name.endswith(".txt"):
                member.type, member.linkname, member.size = tarfile.SYMTYPE, members[0][0].name, 0
                tar.addfile(member)
            elif key in keys and key != keys[1]:
                tar.addfile(member, io.BytesIO(data))


def drop_special_tokens(data: Path) -> None:
    path = data / "tokenizer" / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|pad|>"]
    spec["model"]["vocab"].pop("<|pad|>")
    path.write_text(json.dumps(spec))


# ---------------------------------------------------------------------------------------------
# Mistakes found before any DataLoader starts: one subprocess for all of them
# ---------------------------------------------------------------------------------------------

CHEAP = {  # name -> (overrides, phrases the error line must hold)
    "unknown_group_option": (["attention=bogus"], ["Could not find 'attention/bogus'", "sdpa_docs"]),
    "malformed_override": (["train.seq_len=[1"], ["cannot parse the override 'train.seq_len=[1'"]),
    "unknown_key": (["train.bogus=1"], ["unknown config key 'train.bogus'", "--cfg job"]),
    "unknown_key_appended": (["+train.bogus=1"], ["unknown key(s) in config section 'train': ['bogus']"]),
    "wrong_type": (["train.seq_len=abc"], ["train.seq_len must be an integer, got 'abc'"]),
    "bad_choice": (["packing.layout=zigzag"], ["packing.layout must be one of"]),
    "seq_len_below_2": (["train.seq_len=1"], ["train.seq_len must be >= 2, got 1"]),
    "tokens_per_step_not_rows": (
        ["train.tokens_per_step=1000"],
        ["a positive multiple of train.seq_len (128)", "train.tokens_per_step=896 (7 rows) or 1024 (8 rows)"],
    ),
    "unresolvable": (["model.n_layer=${oops}"], ["cannot resolve model.n_layer"]),
    "unquoted_equals_in_value": (  # e.g. a path into a sweep's `0_layout=packed` run directory
        ["train.init_from=runs/s/0_layout=packed/checkpoints/step_000100"],
        ["must be quoted", "\"train.init_from='runs/s/0_layout=packed/checkpoints/step_000100'\""],
    ),
    "init_from_not_a_checkpoint": (["train.init_from=/nonexistent/step_000001"],
                                   ["/nonexistent/step_000001 is not a packtrain checkpoint"]),
    # An explicit backend is refused where it cannot train (CPU, or fp32, or flash-attn missing), never
    # swapped.
    "flash_unavailable": (["attention=flash"],
                          ["attention backend 'flash' is unavailable", "attention=auto"]),
    "varlen_unavailable": (["attention=torch_varlen"], ["attention backend 'torch_varlen' is unavailable"]),
    "no_data_dir": (["data.path=MISSING"], ["no manifest", "python -m trainer.prepare"]),
    "bad_tokenizer": (["data.path=NO_PAD"],
                      ["tokenizer_config.json: pad_token '<|pad|>' is not in the vocabulary of "
                       "tokenizer.json"]),
    "optimizer_without_betas": (["optim._target_=torch.optim.SGD"],  # a ConfigError, not SGD's TypeError
                                ["optim._target_=torch.optim.SGD does not take betas, eps"]),
}


@pytest.fixture(scope="module")
def cheap_results(demo_data, tmp_path_factory) -> dict[str, tuple[int, str]]:
    root = tmp_path_factory.mktemp("cheap")
    no_pad = copy_of(demo_data, root / "no_pad")
    drop_special_tokens(no_pad)
    paths = {"data.path=MISSING": f"data.path={root / 'missing'}", "data.path=NO_PAD": f"data.path={no_pad}"}
    cases = [
        [f"data.path={demo_data}", f"hydra.run.dir={root / name}", *SMALL,
         *(paths.get(o, o) for o in overrides)]
        for name, (overrides, _) in CHEAP.items()
    ]
    out = root / "results.json"
    proc = subprocess.run([sys.executable, "-c", TRAIN_CLI_DRIVER, json.dumps(cases), str(out)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return dict(zip(CHEAP, map(tuple, json.loads(out.read_text())), strict=True))


@pytest.mark.parametrize("name", list(CHEAP))
def test_a_mistake_found_before_training_is_one_error_line(cheap_results, name):
    code, stderr = cheap_results[name]
    assert_one_error_line(code, stderr, *CHEAP[name][1])


# ---------------------------------------------------------------------------------------------
# Mistakes found in a DataLoader worker, HYDRA_FULL_ERROR=1, torchrun: a process each
# ---------------------------------------------------------------------------------------------


def test_a_truncated_shard_read_in_a_worker_is_one_error_line_and_the_process_ends(demo_data, tmp_path):
    data = copy_of(demo_data, tmp_path / "data")
    rewrite_train_shards(data, truncate)
    t0 = time.perf_counter()
    proc = train_cli(tmp_path / "run", data, "train.max_steps=2")
    line = assert_one_error_line(proc.returncode, proc.stderr, "cannot read shard", "train-00000")
    # the original message only
    assert "Caught DataStreamError" not in line and "DataLoader worker" not in line
    assert time.perf_counter() - t0 < 60  # the worker (which ignores SIGTERM) does not keep the process alive


def test_a_shard_member_that_is_not_a_file_is_one_error_line_naming_the_shard(demo_data, tmp_path):
    data = copy_of(demo_data, tmp_path / "data")
    # webdataset skips the symlink: 4 samples, not the manifest's count
    rewrite_train_shards(data, symlink_second_sample)
    proc = train_cli(tmp_path / "run", data, "train.max_steps=2")
    assert_one_error_line(proc.returncode, proc.stderr, ".tar: read 4 samples but the manifest lists ")


# A bug (not a user's mistake) in the step, with the DataLoader worker running: python -m trainer.train
# otherwise.
BUG = r"""
import sys
import trainer.run.loop
def train_step(*args, **kwargs):
    raise RuntimeError("a bug in the step")
trainer.run.loop.train_step = train_step
from trainer.train import cli
sys.argv = ["trainer.train", *sys.argv[1:]]
cli()
"""


def test_a_bug_keeps_its_traceback_and_the_process_still_ends(demo_data, tmp_path):
    cmd = [sys.executable, "-c", BUG, f"data.path={demo_data}", f"hydra.run.dir={tmp_path}", *SMALL,
           "train.max_steps=2"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert ("Traceback (most recent call last)" in proc.stderr
            and "RuntimeError: a bug in the step" in proc.stderr)
    assert "\nerror: " not in "\n" + proc.stderr
    assert time.perf_counter() - t0 < 60  # its DataLoader worker ignores SIGTERM, yet the process ends


def test_hydra_full_error_keeps_the_traceback(demo_data, tmp_path):
    proc = train_cli(tmp_path / "run", demo_data, "train.seq_len=1", env={**ENV, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "trainer.errors.ConfigError: train.seq_len must be >= 2" in proc.stderr
    assert "\nerror: " not in "\n" + proc.stderr


@pytest.mark.slow
def test_under_torchrun_each_rank_reports_the_mistake_and_the_launch_fails_fast(demo_data, tmp_path):
    """The check runs after the process group is up: both ranks print the line and exit; torchrun fails."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                str(free_port()), "-m", "trainer.train"]
    cmd = [*launcher, f"data.path={demo_data}", f"hydra.run.dir={tmp_path / 'run'}", *SMALL,
           "attention=flash"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert time.perf_counter() - t0 < 60
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all("attention backend 'flash' is unavailable" in e
                                    for e in errors), proc.stderr


# ---------------------------------------------------------------------------------------------
# The pieces, in process
# ---------------------------------------------------------------------------------------------


def test_original_message_unwraps_an_error_re_raised_from_a_dataloader_worker():
    def raise_in_worker() -> None:
        try:
            try:
                raise OSError("disk")
            except OSError as e:
                raise DataStreamError("a.tar: cannot read shard (before its first sample): disk\n"
                                      "second line") from e
        except DataStreamError:
            ExceptionWrapper(where="in DataLoader worker process 0").reraise()

    with pytest.raises(DataStreamError) as caught:
        raise_in_worker()
    assert str(caught.value).startswith("Caught DataStreamError in DataLoader worker process 0.")
    assert original_message(caught.value) == ("a.tar: cannot read shard (before its first sample): disk\n"
                                              "second line")
    assert original_message(ValueError("plain")) == "plain"


def test_one_line_joins_lines():
    assert one_line("a\n\n  b:\n\tc\n") == "a; b: c"


def test_an_explicit_backend_is_refused_not_swapped():
    with pytest.raises(BackendUnavailable, match="attention=auto") as caught:
        resolve_backend("flash", torch.device("cpu"), torch.float32)
    assert "sdpa_docs on this machine" in str(caught.value)
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "sdpa_docs"  # auto may pick


# ---------------------------------------------------------------------------------------------
# Every command, through the one wrapper
# ---------------------------------------------------------------------------------------------

COMMANDS = {  # trainer.<command> -> (argv, "{tmp}" for a fresh directory; a phrase its error line must hold)
    "train": (["train.seq_len=1", "hydra.run.dir={tmp}/run"], "train.seq_len must be >= 2, got 1"),
    "prepare": (["--source", "demo", "--out", "{tmp}/data", "--val-fraction", "2"],
                "val fraction must be in [0, 1)"),
    "report": (["{tmp}/missing"], "missing: not a directory"),
    "inspect_mask": (["--lengths", "3,x", "--out", "{tmp}/inspect"], "expected comma-separated integers"),
    "export": (["{tmp}/missing", "--out", "{tmp}/export"], "missing is not a packtrain checkpoint"),
    "generate": (["{tmp}/missing", "--prompt", "x"], "missing is neither a packtrain checkpoint"),
    "evaluate": (["{tmp}/missing", "--tasks", "cloze"], "missing is neither a packtrain checkpoint"),
    "harness": (["{tmp}/missing", "--tasks", "x"], "missing is neither a packtrain checkpoint"),
    "certify": (["train.seq_len=1", "--out", "{tmp}/cert"], "train.seq_len must be >= 2, got 1"),
    # the rank's line, its status
    "launcher": (["--standalone", "--nproc_per_node=1", "-m", "trainer.train", "train.seq_len=1",
                  "hydra.run.dir={tmp}/run"], "train.seq_len must be >= 2, got 1"),
}


def test_every_command_is_checked():
    commands = {m.removeprefix("trainer.") for m in LAYERS[-1]} - {"trainer"}
    assert set(COMMANDS) == commands, "add the new command's user mistake to COMMANDS"


def test_every_command_shows_a_user_mistake_as_one_error_line(tmp_path):
    procs = {}
    for name, (argv, _) in COMMANDS.items():  # all at once: each start costs seconds
        args = [a.replace("{tmp}", str(tmp_path / name)) for a in argv]
        procs[name] = subprocess.Popen([sys.executable, "-m", f"trainer.{name}", *args], cwd=ROOT, env=ENV,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert_one_error_line(proc.returncode, stderr, COMMANDS[name][1])


def own_error_printing(source: str) -> list[str]:
    """Where `source` shows a user's mistake itself instead of through trainer.errors: each stderr write of a
    text holding "error:", each `return 2` in a main() or cli(), each SystemExit(2) / sys.exit(2)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and _writes_to_stderr(node)
                and any("error:" in t for t in _texts(node.args))):
            found.append((node.lineno, "writes 'error: ...' to stderr"))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("SystemExit", "sys.exit", "exit"):
            if node.args and _is_two(node.args[0]):
                found.append((node.lineno, f"{ast.unparse(node.func)}(2)"))
        elif isinstance(node, ast.FunctionDef) and node.name in ("main", "cli"):
            found += [(r.lineno, f"{node.name}() returns 2") for r in ast.walk(node)
                      if isinstance(r, ast.Return) and r.value is not None and _is_two(r.value)]
    return [f"line {line}: {what}" for line, what in sorted(found)]


def _writes_to_stderr(call: ast.Call) -> bool:
    to_file = any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in call.keywords)
    return (ast.unparse(call.func) == "print" and to_file) or ast.unparse(call.func) == "sys.stderr.write"


def _texts(args: list[ast.expr]) -> list[str]:
    return [n.value for a in args for n in ast.walk(a)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _is_two(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == 2


def test_only_trainer_errors_prints_a_user_mistake():
    package = ROOT / "trainer"
    found = {str(p.relative_to(ROOT)): own_error_printing(p.read_text())
             for p in sorted(package.rglob("*.py"))}
    assert found.pop("trainer/errors.py") != []  # the scan sees the one place that does print it
    assert {path: lines
            for path, lines in found.items() if lines} == {}, "print user mistakes via trainer.errors"


def test_the_scan_finds_a_re_implementation():
    old = (
        "import sys\n"
        "def main(argv=None):\n"
        "    try:\n"
        "        run(argv)\n"
        "    except ValueError as e:\n"
        "        print(f'inspect_mask: error: {e}', file=sys.stderr)\n"
        "        return 2\n"
        "    return 0\n"
        "def fail(e):\n"
        "    sys.stderr.write(f'error: {e}\\n')\n"
        "    raise SystemExit(2)\n"
    )
    assert own_error_printing(old) == ["line 6: writes 'error: ...' to stderr", "line 7: main() returns 2",
                                       "line 10: writes 'error: ...' to stderr", "line 11: SystemExit(2)"]
    assert own_error_printing("def main():\n    print('a decode error: x')\n    return 0\n") == []  # stdout


@pytest.mark.parametrize("error", [DataStreamError, ReportError, InspectError, PrepareError])
def test_each_command_s_own_error_is_a_user_error(error):
    assert issubclass(error, UserError)


def test_run_command_prints_a_user_error_as_one_line_and_returns_2(capsys):
    def mistake() -> None:
        raise DataStreamError("a.tar: bad\nsecond line")

    assert run_command(mistake) == EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: a.tar: bad; second line\n"
    assert run_command(lambda: None) == 0 and run_command(lambda: 3) == 3


def test_run_command_extra_user_errors_tracebacks_and_bugs(capsys):
    def unwritable() -> int:
        raise PermissionError("[Errno 13] Permission denied: '/out'")

    def no_runs() -> int:
        raise ReportError("runs/: no runs found")

    assert run_command(unwritable, extra_user_errors=(OSError,)) == 2
    assert capsys.readouterr().err == "error: [Errno 13] Permission denied: '/out'\n"
    with pytest.raises(PermissionError):  # not a user error unless the command says so
        run_command(unwritable)
    with pytest.raises(ReportError):  # HYDRA_FULL_ERROR=1 in train: every error keeps its traceback
        run_command(no_runs, tracebacks=True)
    with pytest.raises(ZeroDivisionError):
        run_command(lambda: 1 // 0)
    assert capsys.readouterr().err == ""


def test_the_command_decorator_returns_the_exit_status(capsys):
    @command(extra_user_errors=(OSError,))
    def main(argv: list[str] | None = None) -> int:
        if argv:
            raise FileNotFoundError(f"{argv[0]}: no such file")
        return 0

    assert main.__name__ == "main" and main() == 0
    assert main(["x"]) == 2 and capsys.readouterr().err == "error: x: no such file\n"


WORKERS_ALIVE = r"""
import torch
from torch.utils.data import DataLoader, IterableDataset
from trainer.errors import UserError, run_command

class Forever(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(4)

def fail(batches):
    next(batches)  # the workers are up, registered with torch's SIGCHLD handler
    raise UserError("a user's mistake")

codes = []
for _ in range(20):
    batches = iter(DataLoader(Forever(), batch_size=2, num_workers=2))
    try:
        codes.append(run_command(lambda: fail(batches)))
    except BaseException as e:
        codes.append(type(e).__name__)
    del batches
print(codes)
"""


def test_a_user_error_while_dataloader_workers_live_is_one_line_twenty_times_in_a_row():
    """Issue 54: stopping the workers raced torch's SIGCHLD handler, which raised "DataLoader worker (pid N)
    is killed by signal" (exit 1, an 80-line traceback, no error line: 20 of 20 here before the fix). 20 user
    errors, each raised while a 2-worker DataLoader lives: 20 exit statuses 2, 20 lines, no traceback."""
    proc = subprocess.run([sys.executable, "-c", WORKERS_ALIVE], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert (proc.returncode == 0
            and proc.stdout.strip() == str([EXIT_USER_ERROR] * 20)), (proc.stdout, proc.stderr[-3000:])
    assert proc.stderr.splitlines() == ["error: a user's mistake"] * 20, proc.stderr[-3000:]
