"""``benchmarks/policy_ab.py``'s schedule: the prompts in blocks, every arm on every block, the arm
order rotating so that each arm goes first equally often (the machine's drift over a run then
falls on every arm alike), and its flag checks. No server is started."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "policy_ab.py"
_spec = importlib.util.spec_from_file_location("policy_ab", _PATH)
policy_ab = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("policy_ab", policy_ab)
_spec.loader.exec_module(policy_ab)

ARMS = ("ar", "sparsespec-l", "policy")


def test_blocks_cover_the_prompts_in_order_and_rotate_the_arms():
    prompts = list(range(32))
    bl = policy_ab.blocks(prompts, 6, ARMS)
    assert [p for b, _ in bl for p in b] == prompts and [len(b) for b, _ in bl] == [5, 6, 5, 5, 6, 5]
    assert [o for _, o in bl] == [ARMS, ARMS[1:] + ARMS[:1], ARMS[2:] + ARMS[:2]] * 2
    assert all(sorted(o) == sorted(ARMS) for _, o in bl)
    assert policy_ab.blocks(prompts, 1, ARMS) == [(prompts, ARMS)]  # the old schedule


@pytest.mark.parametrize("blocks", ["0", "33"])
def test_blocks_out_of_range_is_a_usage_error(blocks, capsys):
    with pytest.raises(SystemExit) as e:
        policy_ab.main(["--policy", "x.json", "--db", "sqlite://", "--num-prompts", "32", "--blocks", blocks,
                        "--analyze-only"])
    assert e.value.code == 2 and "--blocks must be between 1 and --num-prompts" in capsys.readouterr().err
