"""bench/bench_decode.py without a GPU: its plan through the CLI, its cells and block tables."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import flashcupy.__main__ as cli

from support import ROOT, bench_plan, bench_script

sys.path.insert(0, str(ROOT / "bench"))  # bench_decode imports bench_attention, its neighbour
bd = bench_script("bench_decode")


def _plan(*args: str) -> list[str]:
    return bench_plan("decode", *args)


def test_cli_routes_the_decode_suite_to_bench_decode() -> None:
    assert cli.find_bench_script([ROOT], relative=cli.SUITE_SCRIPTS["decode"]) == ROOT / "bench" / "bench_decode.py"


def test_plan_covers_the_grid_and_skips_what_does_not_fit() -> None:
    lines = _plan()
    run = [line for line in lines if not line.startswith("skip ")]
    skipped = [line for line in lines if line.startswith("skip ")]
    # dtypes x head layouts x batches x keys x Lq x (contiguous + 3 block sizes)
    assert len(run) + len(skipped) == 2 * 2 * 4 * 5 * 2 * 4
    assert all("over --max-cache-gib 8" in line for line in skipped)
    # GQA at B 64, 64k keys: 2 * 64 * 8 * 65536 * 128 * 2 bytes = 16 GiB
    assert any("D=128 32/8 B=64 Lq=1 Lk=65536 contiguous" in line for line in skipped)
    contiguous = [line.split() for line in run if "contiguous" in line]
    paged = [line.split() for line in run if "paged/" in line]
    assert contiguous and all(line[-4:] == ["flashcupy", "sdpa-default", "flex", "copy"] for line in contiguous)
    assert paged and all(line[-2:] == ["flashcupy", "sdpa-default"] for line in paged)


def test_narrowed_plan_and_whole_blocks_only() -> None:
    lines = _plan("--dtypes", "bfloat16", "--heads", "mha", "--batches", "2", "--keys", "1000", "--queries", "1",
                  "--block-sizes", "16", "8")
    assert lines[0].split()[:7] == ["bfloat16", "D=64", "32/32", "B=2", "Lq=1", "Lk=1000", "contiguous"]
    assert [line.split()[6] for line in lines if not line.startswith("skip ")] == ["contiguous", "paged/8"]
    assert [line for line in lines if line.startswith("skip ")] == [
        "skip bfloat16 D=64 32/32 B=2 Lq=1 Lk=1000 paged/16: 1000 keys are not whole blocks of 16"]


@pytest.mark.parametrize("bad", [["--batches", "0"], ["--keys", "-4"], ["--heads", "mqa"]])
def test_bad_arguments_exit_2(bad) -> None:
    with pytest.raises(SystemExit) as raised:
        bd.parse_args(bad)
    assert raised.value.code == 2


def test_cache_bytes_and_rotation() -> None:
    cell = bd.Cell("float16", 128, 32, 8, 8, 1, 4096, "paged", 64)
    assert cell.cache_bytes == 2 * 8 * 8 * 4096 * 128 * 2  # K and V, 2 bytes an element
    assert cell.sets == 2  # 128 MiB of K and V: two sets make 256 MiB
    assert bd.Cell("bfloat16", 64, 32, 32, 1, 1, 1024, "contiguous", 0).sets == bd.MAX_SETS
    assert bd.Cell("float16", 128, 32, 8, 64, 1, 16384, "contiguous", 0).sets == 1


def test_block_table_is_a_permutation_of_the_batch_blocks() -> None:
    table = bd.block_table(3, 5, np.random.default_rng(1))
    assert table.shape == (3, 5) and table.dtype == np.int32
    assert sorted(table.reshape(-1).tolist()) == list(range(15))
    assert not np.array_equal(table.reshape(-1), np.arange(15))  # out of order
