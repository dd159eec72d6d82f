"""Do the simulation's invariants catch mistakes? Mutation testing of the decision code it runs.

1. Runs a few seeds of `msd.sim` with a line tracer on the decision modules (TARGETS) to find the
   statements the simulation executes.
2. Draws mutants among them: a statement deleted (replaced by `pass`), or the condition of an
   `if`, `while` or conditional expression negated. Log calls, docstrings and `raise` are left
   alone (deleting a log line changes nothing the invariants could see).
3. Runs each mutant in a fresh process (the mutated module compiled in place of the original)
   over the same seeds; a mutant is caught when a seed fails, the run raises, or it times out.
   Each seed's faulty run is compared with the fault-free stream of the unmutated code (computed
   once, here): a mistake that changes the stream the same way with and without faults is caught
   too, as the golden streams test would catch it.

    python tools/mutate_sim.py --mutants 150 --seeds 6 --steps 25 --json docs/results/issue58/mutation.json

Prints JSON: mutants, caught, the share caught, and the survivors (file, line, kind, source).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGETS = ("coordinator/state.py", "coordinator/preparation.py", "coordinator/deliveries.py", "coordinator/tasks.py",
           "coordinator/registry.py", "coordinator/positions.py", "coordinator/plan.py", "coordinator/history.py",
           "coordinator/layout.py", "coordinator/resume.py", "coordinator/skips.py", "coordinator/relay_book.py",
           "coordinator/relaying.py", "worker/core.py", "relay/core.py", "trainer_client/receiving.py",
           "trainer_client/rank_core.py", "trainer_client/assemble.py", "msd_common/session.py",
           "coordinator/evaluation.py")


def _targets() -> list[str]:
    return [t for t in TARGETS if os.path.exists(os.path.join(ROOT, t))]


def covered_lines(seeds: list[int], steps: int) -> dict[str, set[int]]:
    """The lines of each target the simulation runs."""
    from msd.sim.run import run_seed

    paths = {os.path.join(ROOT, t): t for t in _targets()}
    hits: dict[str, set[int]] = {t: set() for t in paths.values()}

    def local(frame, event, arg):
        if event == "line":
            hits[paths[frame.f_code.co_filename]].add(frame.f_lineno)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in paths else None

    sys.settrace(tracer)
    try:
        for seed in seeds:
            run_seed(seed, steps)
    finally:
        sys.settrace(None)
    return hits


def _is_log_call(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and isinstance(node.value.func.value, ast.Name)
            and node.value.func.value.id in ("log", "logging", "logger"))


def candidates(path: str, lines: set[int]) -> list[tuple[str, int, int, str]]:
    """(path, line, col, kind) of every mutation on a covered line."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    out = []
    for node in ast.walk(tree):
        if not hasattr(node, "lineno") or node.lineno not in lines:
            continue
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                                 ast.Import, ast.ImportFrom, ast.Pass, ast.Raise,
                                                                 ast.Global, ast.Nonlocal)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # a docstring
            if _is_log_call(node):
                continue
            out.append((path, node.lineno, node.col_offset, "delete"))
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            out.append((path, node.lineno, node.col_offset, "negate"))
    return out


class _Mutate(ast.NodeTransformer):
    def __init__(self, line: int, col: int, kind: str) -> None:
        self.line, self.col, self.kind = line, col, kind
        self.done = False

    def _here(self, node: ast.AST) -> bool:
        return not self.done and getattr(node, "lineno", None) == self.line and node.col_offset == self.col

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if self._here(node):
            if self.kind == "negate" and isinstance(node, (ast.If, ast.While, ast.IfExp)):
                self.done = True
                node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
                return ast.fix_missing_locations(node)
            if self.kind == "delete" and isinstance(node, ast.stmt):
                self.done = True
                return ast.copy_location(ast.Pass(), node)
        return super().generic_visit(node)


def load_mutant(path: str, line: int, col: int, kind: str) -> None:
    """Compile the mutated module and put it in sys.modules in place of the original."""
    full = os.path.join(ROOT, path)
    tree = _Mutate(line, col, kind).visit(ast.parse(open(full).read()))
    name = path[:-3].replace("/", ".")
    package = name.rpartition(".")[0]
    __import__(package)
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(ast.fix_missing_locations(tree), full, "exec"), module.__dict__)
    setattr(sys.modules[package], name.rpartition(".")[2], module)


def references(seeds: list[int], steps: int, path: str) -> None:
    """Each seed's fault-free stream by the unmutated code, to a JSON file the mutants read."""
    from msd.sim.run import Simulation, draw

    out = {}
    for seed in seeds:
        sim = Simulation(draw(seed, steps).fault_free(), steps, None)
        assert sim.run()["ok"], f"seed {seed}: the fault-free run fails without a mutant"
        out[str(seed)] = [[rank, step, digests] for (rank, step), digests in sim.trainer.stream.items()]
    with open(path, "w") as f:
        json.dump(out, f)


def run_mutant(args: argparse.Namespace) -> int:
    path, line, col, kind = args.mutant.split(":")
    load_mutant(path, int(line), int(col), kind)
    from msd.sim.run import Simulation, draw

    with open(args.references) as f:
        refs = json.load(f)
    for seed in args.seed_list:
        reference = {(rank, step): digests for rank, step, digests in refs[str(seed)]}
        result = Simulation(draw(seed, args.steps), args.steps, reference).run()
        if not result["ok"]:
            print(json.dumps({"caught_by": seed, "error": result["error"][:200]}))
            return 1
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=6, help="seeds each mutant runs (the first --first-seed on)")
    ap.add_argument("--first-seed", type=int, default=7000)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=180.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rerun", default=None,
                    help="an earlier run's JSON: its caught mutants are kept, the rest run again")
    ap.add_argument("--mutant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed-list", type=int, nargs="*", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--references", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mutant:
        sys.exit(run_mutant(args))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    started = time.time()
    hits = covered_lines(seeds, args.steps)
    refs_path = os.path.join(ROOT, f".mutate-sim-references-{os.getpid()}.json")
    references(seeds, args.steps, refs_path)
    pool = [c for path, lines in sorted(hits.items()) for c in candidates(path, lines)]
    rng = random.Random(args.first_seed)
    chosen = sorted(rng.sample(pool, min(args.mutants, len(pool))))
    earlier: dict[tuple, dict] = {}
    if args.rerun:  # only the mutants an earlier run did not catch run again (invariants only grow)
        with open(args.rerun) as f:
            earlier = {(r["file"], r["line"], r["kind"], r["source"]): r for r in json.load(f)["results"]}

    def one(c: tuple[str, int, int, str]) -> dict:
        src = open(os.path.join(ROOT, c[0])).read().splitlines()[c[1] - 1].strip()
        before = earlier.get((c[0], c[1], c[3], src[:120]))
        if before is not None and before["caught"]:
            return before
        cmd = [sys.executable, __file__, "--mutant", ":".join(map(str, c)), "--steps", str(args.steps),
               "--references", refs_path, "--seed-list", *map(str, seeds)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, cwd=ROOT)
            caught, how = p.returncode != 0, (p.stdout.strip() or p.stderr.strip()[-200:])
        except subprocess.TimeoutExpired:
            caught, how = True, "timed out"
        return {"file": c[0], "line": c[1], "kind": c[3], "source": src[:120], "caught": caught, "how": how[-200:]}

    try:
        with ThreadPoolExecutor(args.jobs) as ex:
            results = list(ex.map(one, chosen))
    finally:
        os.unlink(refs_path)
    caught = sum(r["caught"] for r in results)
    by_file: dict[str, list[int]] = {}
    for r in results:
        n = by_file.setdefault(r["file"], [0, 0])
        n[0] += r["caught"]
        n[1] += 1
    out = {"mutants": len(results), "caught": caught, "share_caught": round(caught / max(1, len(results)), 3),
           "candidates": len(pool), "covered_lines": sum(len(v) for v in hits.values()), "seeds": seeds,
           "steps": args.steps, "by_file": {f: f"{a}/{b}" for f, (a, b) in sorted(by_file.items())},
           "wall_s": round(time.time() - started, 1),
           "survivors": [r for r in results if not r["caught"]]}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
