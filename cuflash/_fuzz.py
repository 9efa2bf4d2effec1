"""``python -m cuflash fuzz``: a correctness campaign of cuflash against its float64 oracle.

Draws ``--examples`` cases from :func:`cuflash.testing.attention_cases` (Hypothesis, seeded by
``--seed``, no example database), runs ``cuflash.attention`` on each (into an output buffer
poisoned with NaN, so an element left unwritten fails) and, on a ``--grads`` share of them,
``cuflash.attention_backward``, and checks every result with
:func:`cuflash.testing.assert_attention_close`. A failure (a wrong result or an exception) is
recorded with its reproducer (an ``.npz`` for ``AttentionCase.from_npz`` and the case's
``describe()``); the campaign goes on unless ``--stop-on-failure``, which stops at the first
failure and shrinks it to a minimal case first. Progress goes to stderr, a JSON report to
``--report``. Exit status: 0 all passed, 1 a failure, 2 bad arguments.

``--features`` picks the keywords cases may use (default: all, the modifiers included). On the
GPU, the modifiers its kernels do not implement yet (:func:`gpu_unsupported`) are left out of
the campaign and listed with the reason under ``features_skipped`` in the report;
``features_fuzzed`` counts, per feature fuzzed, the examples that had it on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import zlib
from collections import Counter
from typing import Any, Sequence

import numpy

DTYPES = ("float16", "bfloat16", "float32", "float64")


class _Usage(Exception):
    """A bad argument: reported in one line, exit status 2."""


class _TimeUp(BaseException):
    """Raised inside the Hypothesis test to end the campaign at --time-limit (a BaseException,
    so that Hypothesis lets it through at once instead of treating it as a failure)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block, no traceback
        raise _Usage(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m cuflash fuzz",
                description="Fuzz cuflash against its float64 reference (cuflash.testing).")
    p.add_argument("--examples", type=int, default=200, help="number of cases (default 200)")
    p.add_argument("--features", nargs="+", default=None,
                   help="keywords the cases may use: scale, causal and the modifiers window, "
                        "softcap, alibi_slopes, sink, bias, mask, score_mod, mask_mod, "
                        "block_mask (default: every known feature); on the GPU those its "
                        "kernels do not implement yet are skipped, with the reason in the report")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), help="default: all four")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
    p.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="gpu: CuPy arrays on the current device; cpu: NumPy arrays (cuflash's "
                        "CPU path). Default: gpu when CuPy sees a device")
    p.add_argument("--grads", type=float, nargs="?", const=1.0, default=0.25, metavar="SHARE",
                   help="share of the cases that also check the backward (default 0.25; "
                        "--grads alone: all; --grads 0: none)")
    p.add_argument("--max-seqlen", type=int, default=128, help="longest Lq, Lk (default 128)")
    p.add_argument("--stop-on-failure", action="store_true",
                   help="stop at the first failure, after shrinking it to a minimal case")
    p.add_argument("--report", default="fuzz-report.json",
                   help="JSON report path (default fuzz-report.json); reproducers go to "
                        "<report>.failures/")
    p.add_argument("--time-limit", type=float, default=0.0, metavar="SECONDS",
                   help="stop starting new examples after this many seconds and report those "
                        "run (default: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _device(name: str | None):
    """``(xp, description)`` for the device asked for (or the best available)."""
    if name != "cpu":
        try:
            import cupy
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:      # no CuPy, no driver: the CPU unless the GPU was asked for
            if name == "gpu":       # (helper firsthour: the reason in a user's words)
                from cuflash._cli_common import usable_gpu
                raise _Usage(f"--device gpu, but CuPy cannot use a device: "
                             f"{usable_gpu()[1] or type(e).__name__}")
            n = 0
        if n > 0:
            dev = cupy.cuda.Device()
            props = cupy.cuda.runtime.getDeviceProperties(dev.id)
            pname = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            return cupy, (f"gpu {dev.id}: {pname} (compute capability "
                          f"{props['major']}.{props['minor']}), CuPy {cupy.__version__}")
        if name == "gpu":
            raise _Usage("--device gpu, but CUDA reports no device")
    return numpy, f"cpu: NumPy {numpy.__version__} ({platform.processor() or platform.machine()})"


class _Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, otherwise a line
    every 5% of the examples."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = max(1, total), quiet
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.last_draw, self.last_step = 0.0, -1

    def update(self, done: int, failures: int, final: bool = False) -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        step = done * 20 // self.total
        if not final and (now - self.last_draw < 0.5 if self.tty else step == self.last_step):
            return
        self.last_draw, self.last_step = now, step
        elapsed = now - self.start
        per = elapsed / done if done else 0.0
        bar = "#" * (done * 30 // self.total) + "." * (30 - done * 30 // self.total)
        eta = per * max(0, self.total - done)
        line = (f"[{bar}] {done}/{self.total} examples, {failures} failure"
                f"{'' if failures == 1 else 's'}, {elapsed:.1f} s ({per * 1e3:.1f} ms each)"
                + ("" if final else f", eta {eta:.0f} s"))
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def gpu_unsupported(features: Sequence[str]) -> dict[str, str]:
    """The features among ``features`` that cuflash's GPU kernels do not implement yet, each
    with the reason. Asked of one place, ``cuflash._modifiers.GPU_FEATURES`` (what
    ``check_gpu_support`` also reads, grown family by family by issue 10), never learned by
    catching NotImplementedError: a campaign must not mistake a missing feature for a bug, nor
    hide a real NotImplementedError."""
    from cuflash import _modifiers
    names = [n for n in features if n in _modifiers.KEYWORDS or n == "block_mask"]
    missing = set(_modifiers.gpu_missing_features(names, "attention"))
    out = {}
    for name in names:
        if name in missing:
            out[name] = (f"the GPU forward does not implement {name} yet (cuflash._modifiers."
                         f"GPU_FEATURES['attention']); fuzz it with --device cpu")
        elif name == "block_mask" and "mask_mod" in missing:
            out[name] = ("block_mask runs its mask_mod, which the GPU kernels do not implement "
                         "yet; fuzz it with --device cpu")
    return out


def gpu_backward_missing(case: Any) -> list[str]:
    """The modifiers of ``case`` that the GPU backward does not implement for its dtype and
    head dims (the same rule as the API's NotImplementedError): a case with any of them checks
    its forward only."""
    from cuflash import _modifiers
    on = [n for n, v in case.kwargs.items()
          if (n in _modifiers.KEYWORDS or n == "block_mask") and v is not None]
    dmax = max(case.q.shape[-1], case.v.shape[-1])
    return _modifiers.gpu_missing_features(on, "attention_backward", case.dtype, dmax)


def check_case(case: Any, xp: Any, grads: bool) -> float:
    """cuflash on ``case`` against the oracle: forward (poisoned ``out``), then the backward."""
    import cuflash
    from cuflash.testing import assert_attention_close
    g = case.geometry()
    out = xp.full(g.batch_shape + (g.Lq, g.dv), numpy.nan, dtype=case.dtype)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, out=out, **case.kwargs)
    if o is not out:
        raise AssertionError("cuflash.attention(out=...) did not return out")
    worst = assert_attention_close(o, case, lse=lse, check_dtype=True)
    if grads:
        grads = cuflash.attention_backward(case.do, case.q, case.k, case.v, o, lse,
                                           **case.kwargs)   # dq, dk, dv[, dbias][, dsink]
        worst = max(worst, assert_attention_close(None, case, grads=grads, check_dtype=True))
    return worst


def _count(counts: dict, case: Any, grads: bool) -> None:
    counts.setdefault("dtype", Counter())[case.dtype.name] += 1
    for key, value in case.keywords.items():
        if key == "scale":
            label = "default" if value is None else "given"
        elif isinstance(value, dict):   # an array spec or a block mask
            label = ("-inf entries" if value.get("hide") else "finite") if key == "bias" \
                else str(value.get("mask_mod", "on"))
        else:
            label = str(value)
        counts.setdefault(key, Counter())[label] += 1
        if value is not None and value is not False:   # the feature is on in this case
            counts.setdefault("features_on", Counter())[key] += 1
    counts.setdefault("grads", Counter())[str(grads)] += 1
    g = case.geometry()
    shape = "Lq>Lk" if g.Lq > g.Lk else "Lq<Lk" if g.Lq < g.Lk else "Lq=Lk"
    counts.setdefault("lengths", Counter())[shape] += 1
    counts.setdefault("d", Counter())["d!=dv" if g.d != g.dv else "d=dv"] += 1
    counts.setdefault("batch_dims", Counter())[str(len(g.batch_shape))] += 1
    if g.visible is not None and not g.visible_full().any(axis=-1).all():
        counts.setdefault("special", Counter())["rows with no visible key"] += 1
    if any(0 in getattr(case, n).strides for n in "qkv"):
        counts.setdefault("special", Counter())["stride-0 operand"] += 1


def run_campaign(args, xp, device: str, log=sys.stderr) -> dict:
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings, target
    from cuflash import testing

    features = args.features if args.features is not None else list(testing.FEATURES)
    unknown = [f for f in features if f not in testing.FEATURES]
    if unknown:
        raise _Usage(f"unknown features {unknown}; known: {sorted(testing.FEATURES)}")
    skipped = gpu_unsupported(features) if xp is not numpy else {}
    for name, reason in skipped.items():
        print(f"skipping feature {name}: {reason}", file=log)
    fuzzed = [f for f in features if f not in skipped]
    try:
        strategy = testing.attention_cases(dtypes=args.dtypes, features=fuzzed, xp=xp,
                                           max_seqlen=args.max_seqlen)
    except (TypeError, ValueError) as e:
        raise _Usage(str(e))
    share = int(round(args.grads * 1000))
    fail_dir = f"{args.report}.failures"
    failures: list[dict] = []
    counts: dict = {}
    state = {"done": 0, "worst": 0.0}
    progress = _Progress(args.examples, args.quiet)

    def record(case, grads, exc) -> dict:
        os.makedirs(fail_dir, exist_ok=True)
        path = os.path.join(fail_dir, f"failure-{len(failures):04d}.npz")
        try:
            case.to_npz(path)
        except Exception as e:       # a reproducer that cannot be written still has describe()
            path = f"(not written: {type(e).__name__}: {e})"
        text = str(exc)
        entry = dict(example=state["done"], grads=grads, error_type=type(exc).__name__,
                     error=text.split("\nAttentionCase ")[0], npz=path,
                     describe=case.describe(), reproduce=f"cuflash.testing.{case!r}")
        failures.append(entry)
        return entry

    phases = [Phase.generate] + ([Phase.shrink] if args.stop_on_failure else [])

    @seed(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, derandomize=False,
              phases=phases, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
              verbosity=Verbosity.quiet, print_blob=False)
    @given(case=strategy)
    def campaign(case):
        if args.time_limit and time.perf_counter() - start > args.time_limit:
            raise _TimeUp
        # a share of the cases also run the backward: a hash of the case decides (uniform,
        # unlike a Hypothesis draw, which favours small values; and the same for the same case,
        # so that shrinking keeps it)
        grads = zlib.crc32(repr(case).encode()) % 1000 < share
        if grads and xp is not numpy and gpu_backward_missing(case):
            grads = False          # counted under "grads_not_on_gpu", not as a failure
            counts.setdefault("grads_not_on_gpu", Counter())[
                ",".join(gpu_backward_missing(case))] += 1
        shrinking = args.stop_on_failure and failures
        if not shrinking:
            state["done"] += 1
            _count(counts, case, grads)
        try:
            ratio = check_case(case, xp, grads)
        except Exception as exc:     # a wrong result, or cuflash raising on valid input
            if shrinking:
                failures[-1:] = []   # keep only the smallest failing case seen
            record(case, grads, exc)
            progress.update(state["done"], len(failures))
            if args.stop_on_failure:
                raise
            return
        state["worst"] = max(state["worst"], ratio)
        target(ratio, label="error / bound")
        progress.update(state["done"], len(failures))

    start = time.perf_counter()
    stopped = None
    try:
        campaign()
    except _TimeUp:
        stopped = f"time limit of {args.time_limit:g} s"
    except Exception:
        if not failures:             # Hypothesis itself failed: not a finding about cuflash
            raise
    wall = time.perf_counter() - start
    progress.update(state["done"], len(failures), final=True)
    import cuflash
    return dict(
        examples=state["done"], examples_requested=args.examples, stopped_early=stopped,
        failures=failures, n_failures=len(failures),
        passed=not failures, wall_s=round(wall, 2),
        ms_per_example=round(1e3 * wall / max(1, state["done"]), 2),
        worst_error_over_bound=round(state["worst"], 4), device=device, seed=args.seed,
        dtypes=list(args.dtypes), features=list(features), features_fuzzed={
            f: counts.get("features_on", {}).get(f, 0) for f in fuzzed},
        features_skipped=skipped, max_seqlen=args.max_seqlen,
        grads_share=args.grads, stop_on_failure=args.stop_on_failure,
        counts={k: dict(sorted(v.items())) for k, v in counts.items()},
        cuflash_version=cuflash.__version__, numpy=numpy.__version__,
        python=platform.python_version())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        if args.examples < 1:
            raise _Usage(f"--examples must be at least 1, got {args.examples}")
        if not 0.0 <= args.grads <= 1.0:
            raise _Usage(f"--grads must be a share in [0, 1], got {args.grads}")
        if args.time_limit < 0:
            raise _Usage(f"--time-limit must be >= 0, got {args.time_limit}")
        if args.max_seqlen < 1:
            raise _Usage(f"--max-seqlen must be at least 1, got {args.max_seqlen}")
        try:
            import hypothesis  # noqa: F401
        except ImportError:
            raise _Usage("fuzz needs Hypothesis: pip install cuflash[testing]")
        xp, device = _device(args.device)
        print(f"cuflash fuzz: {args.examples} examples on {device}, seed {args.seed}",
              file=sys.stderr)
        report = run_campaign(args, xp, device)
    except _Usage as e:
        print(f"python -m cuflash fuzz: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:          # --help
        return int(e.code or 0)
    report["command"] = "python -m cuflash fuzz " + " ".join(argv)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)
    for entry in report["failures"][:5]:
        print(f"\nFAILURE at example {entry['example']} ({entry['error_type']}): "
              f"{entry['error']}\n{entry['describe']}\n  npz: {entry['npz']}", file=sys.stderr)
    more = report["n_failures"] - 5
    if more > 0:
        print(f"... and {more} more in {args.report}", file=sys.stderr)
    if report["stopped_early"]:
        print(f"stopped early at the {report['stopped_early']}: {report['examples']} of "
              f"{args.examples} examples run", file=sys.stderr)
    print(f"{report['examples']} examples, {report['n_failures']} failures, "
          f"{report['wall_s']} s ({report['ms_per_example']} ms each) on {report['device']}; "
          f"worst error/bound {report['worst_error_over_bound']}; report: {args.report}")
    return 1 if report["n_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
