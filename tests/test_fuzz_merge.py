"""bench/fuzz_merge.py: the shards of one fuzz campaign merged into one report."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import fuzz_merge  # noqa: E402


def shard(seed, examples, failures=(), worst=0.5, wall=10.0, device="gpu 0"):
    return dict(examples=examples, examples_requested=examples, stopped_early=None,
                failures=[dict(example=e) for e in failures], n_failures=len(failures),
                passed=not failures, wall_s=wall, ms_per_example=1e3 * wall / examples,
                worst_error_over_bound=worst, device=device, seed=seed, dtypes=["float16"],
                features=["causal", "bias"], features_fuzzed={"causal": seed, "bias": 1},
                max_seqlen=128, grads_share=0.25, counts={"dtype": {"float16": examples},
                                                          "grads": {"True": seed}},
                cuflash_version="0.1.0", command=f"--seed {seed}")


def test_sums_counts_and_keeps_failures_with_their_shard(tmp_path):
    paths = []
    for s in (shard(1, 100, wall=20.0), shard(2, 50, failures=(7,), worst=0.9, wall=30.0)):
        paths.append(tmp_path / f"s{s['seed']}.json")
        paths[-1].write_text(json.dumps(s))
    out = tmp_path / "fuzz.json"
    assert fuzz_merge.main([str(out)] + [str(p) for p in paths]) == 1   # a failure: exit 1
    m = json.loads(out.read_text())
    assert m["examples"] == 150 and m["n_failures"] == 1 and m["passed"] is False
    assert m["failures"] == [{"example": 7, "shard": 2}]
    assert m["counts"] == {"dtype": {"float16": 150}, "grads": {"True": 3}}
    assert m["features_fuzzed"] == {"causal": 3, "bias": 2}
    assert m["seeds"] == [1, 2] and m["wall_s"] == 30.0 and m["worst_error_over_bound"] == 0.9
    assert m["ms_per_example"] == round(1e3 * 50.0 / 150, 2)


def test_shards_of_different_devices_are_refused():
    with pytest.raises(SystemExit, match="device"):
        fuzz_merge.merge([shard(1, 10), shard(2, 10, device="cpu")])
