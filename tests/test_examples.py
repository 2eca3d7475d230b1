"""The examples, run by shmdist-run as a user would, print what the send page shows."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_launcher import launch, rank_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Each example's output lines (with --prefix-output), for torch tensors and for numpy arrays.
SEND_EXAMPLES = {
    "send_basic.py": (2, {"torch": ["[rank 0] Tensor sent",
                                    "[rank 1] Tensor received: tensor([1, 2, 3, 4, 5])"],
                          "numpy": ["[rank 0] Tensor sent",
                                    "[rank 1] Tensor received: [1 2 3 4 5]"]}),
    "send_pair.py": (2, {"torch": ["[rank 0] Process 0 sent tensor: tensor([10, 20, 30, 40, 50])",
                                   "[rank 1] Process 1 received tensor: tensor([10, 20, 30, 40, 50])"],
                         "numpy": ["[rank 0] Process 0 sent tensor: [10 20 30 40 50]",
                                   "[rank 1] Process 1 received tensor: [10 20 30 40 50]"]}),
    "send_group.py": (4, {"torch": ["[rank 0] Tensor sent to rank 2 in custom group",
                                    "[rank 2] Rank 2 received tensor in custom group: "
                                    "tensor([100, 200, 300])"],
                          "numpy": ["[rank 0] Tensor sent to rank 2 in custom group",
                                    "[rank 2] Rank 2 received tensor in custom group: [100 200 300]"]}),
}

# How an example is told to use numpy: not at all (torch), by its flag, or by the environment.
VARIANTS = {"torch": ([], {}), "numpy-flag": (["--numpy"], {}),
            "numpy-env": ([], {"SHMDIST_EXAMPLE_NUMPY": "1"})}


def run_example(name: str, nproc: int, *args: str, **env: str):
    result = launch("--prefix-output", "-n", str(nproc), str(EXAMPLES / name), *args, env=rank_env(**env))
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", SEND_EXAMPLES)
def test_send_example_prints_what_the_page_shows(name, variant):
    if variant == "torch":
        pytest.importorskip("torch")
    args, env = VARIANTS[variant]
    nproc, expected = SEND_EXAMPLES[name]
    result = run_example(name, nproc, *args, **env)
    assert sorted(result.stdout.splitlines()) == expected["torch" if variant == "torch" else "numpy"]


@pytest.mark.parametrize("nproc", [2, 3])
def test_allreduce_training_ends_with_the_same_weights_on_every_rank(nproc):
    result = run_example("allreduce_train.py", nproc, "--steps", "100")
    lines = result.stdout.splitlines()
    loss_line = re.compile(r"\[rank 0\] step +\d+ +loss (\S+)")
    losses = [float(m.group(1)) for m in map(loss_line.match, lines) if m]
    assert len(losses) == 6 and losses == sorted(losses, reverse=True)   # steps 1, 20, ..., 100
    assert losses[-1] < 0.02 < losses[0]
    finals = sorted(line.partition(": final weights ")[2] for line in lines if "final weights" in line)
    assert len(finals) == nproc and len(set(finals)) == 1, finals   # bit for bit: same checksum
    weights = [float(x) for x in finals[0].partition("]")[0].strip("[ ").split()]
    assert weights == pytest.approx([2.0, -3.0, 0.5, 1.0, 4.0], abs=0.05)
