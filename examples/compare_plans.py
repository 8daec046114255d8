"""Are two versions of the planner's code choosing the same plans? ``dump`` plans a fixed set of batches
(both shared length samples, 8 to 512 ranks, a few variants: half the communication hidden, a sliding
window, no key-split tiles, half the ranks serving) with ``tolerance="auto"`` and writes them with their
predicted step (``step_seconds``); ``compare`` reports the batches whose plans differ, and whether the
second file's plan is predicted faster or slower. Run ``dump`` once per version, the version chosen by
``PYTHONPATH`` (a tree of the other version, e.g. ``git archive main distca_hf | tar -x -C /tmp/old``),
from a folder that holds no ``distca_hf`` of its own:

    PYTHONPATH=/tmp/old python examples/compare_plans.py dump old.pkl
    PYTHONPATH=.        python examples/compare_plans.py dump new.pkl
    python examples/compare_plans.py compare old.pkl new.pkl
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import sys
import zlib
from pathlib import Path

import numpy as np

CASES = [  # (ranks, tokens per rank, batches per sample, variant)
    (8, 32768, 4, "plain"), (8, 131072, 4, "plain"), (64, 32768, 4, "plain"), (64, 65536, 6, "plain"),
    (64, 131072, 4, "plain"), (512, 131072, 2, "plain"), (64, 65536, 2, "hidden"), (64, 65536, 2, "window"),
    (64, 65536, 2, "nokeysplit"), (16, 65536, 2, "servers")]
COLUMNS = ("source", "server", "doc", "q_start", "q_end", "k_start", "k_end")


def dump(data: Path, out: Path) -> None:
    import distca_hf
    from distca_hf.config import SETTINGS
    from distca_hf.planning import PlannerConfig, plan_tasks, step_seconds
    from distca_hf.planning.cost import H100_MEASURED
    from distca_hf.tools.simulate import draw_batch, load_lengths, pack_pieces

    print(f"planning with {Path(distca_hf.__file__).parent}", file=sys.stderr)
    base = PlannerConfig(tolerance="auto", block=128, memory_budget=SETTINGS["memory_budget"].default, key_split=True,
                         time_model=H100_MEASURED)
    plans = {}
    for name in ("prolong", "wlbllm"):
        lengths = load_lengths(data / f"doc_lengths_{name}.json")
        for ranks, tokens, count, variant in CASES:
            rng = np.random.default_rng(zlib.crc32(repr((name, ranks, tokens, variant)).encode()))
            config = {"hidden": dataclasses.replace(base, exposed_comm=0.5),
                      "window": dataclasses.replace(base, window=4096),
                      "nokeysplit": dataclasses.replace(base, key_split=False),
                      "servers": dataclasses.replace(base, servers=tuple(range(0, ranks, 2)))}.get(variant, base)
            for i in range(count):
                pieces = pack_pieces(draw_batch(lengths, ranks * tokens, rng), ranks, tokens)
                plan = plan_tasks(pieces, config)
                plans[(name, ranks, tokens, variant, i)] = (
                    {c: None if getattr(plan, c) is None else np.asarray(getattr(plan, c)).copy() for c in COLUMNS},
                    plan.backward, step_seconds(plan, pieces, config))
    out.write_bytes(pickle.dumps(plans))
    print(f"{len(plans)} plans -> {out}", file=sys.stderr)


def compare(old_path: Path, new_path: Path) -> int:
    old, new = pickle.loads(old_path.read_bytes()), pickle.loads(new_path.read_bytes())
    same = 0
    for key in old:
        (a, mode_a, seconds_a), (b, mode_b, seconds_b) = old[key], new[key]
        equal = mode_a == mode_b and all(
            (a[c] is None and b[c] is None) or (a[c] is not None and b[c] is not None and np.array_equal(a[c], b[c]))
            for c in COLUMNS)
        if equal:
            same += 1
            continue
        verdict = "faster" if seconds_b < seconds_a else "SLOWER" if seconds_b > seconds_a else "as fast"
        print(f"differs: {key}: {1e3 * seconds_a:.4f} ms -> {1e3 * seconds_b:.4f} ms predicted ({verdict})")
    print(f"{same} of {len(old)} plans identical")
    return 0 if same == len(old) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # (distca_hf imported later, per checkout)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1] / ".." / "shared" / "data")
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.data, args.out)
        return 0
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
