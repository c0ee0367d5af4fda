"""The objectives' acceptance matrix of `megatron-tree verify`, float64, in one run: each objective (GSPO, the
preference losses, reward and value models, distillation, the loss aggregations) on every model family and the
parallel layouts (TP 2 + SP, PP 2, CP 2, DP 2, EP 2 over DP 2 (verify gives the dense families 4 experts), carry at
16 rows over DP 2; qwen3next without CP, which stock's config refuses for its GDN variant; DSA's TP 2 without SP, as
verify runs it). Prints one line per config with every metric's max relative error against per-sample training: a
config passes when verify passes (its float64 tolerance, 1e-9, for every metric; the parameters after an Adam step
amplify rounding on near-zero gradients) and its loss and gradients are within --tolerance; then the worst loss /
gradient error per loss.

    python tools/verify_objectives.py [--losses rm value distill] [--families gpt hybrid ...] [--tolerance 1e-12]
"""
from __future__ import annotations

import argparse
import time

FAMILIES = {"gpt": ("gpt", None), "hybrid": ("hybrid", "MG*-*E"), "mamba": ("mamba", None),
            "qwen3next": ("qwen3next", None), "mla": ("mla", None), "dsa": ("dsa", None)}
LAYOUTS = {"tp2+sp": dict(tp=2, sp=True), "pp2": dict(pp=2), "cp2": dict(cp=2), "dp2": dict(dp=2),
           "ep2": dict(ep=2, dp=2), "carry": dict(dp=2, carry=True, budget=16)}
LOSSES = ("gspo", "dpo", "ipo", "simpo", "rm", "value", "distill", "grpo:seq-mean-token-mean")


def _configs(losses, families, layouts, tol) -> list:
    from megatron_tree.training.verify import VerifyConfig

    out = []
    for loss in losses:
        name, _, agg = loss.partition(":")
        for fam in families:
            model, pattern = FAMILIES[fam]
            for lay in layouts:
                kw = dict(LAYOUTS[lay])
                if model == "dsa" and kw.get("sp"):  # verify's DSA has no sequence parallelism (its docstring)
                    kw.pop("sp")
                if model == "qwen3next" and kw.get("cp", 1) > 1:  # stock TransformerConfig refuses CP with its GDN
                    continue  # variant; GDN under tree CP runs in the hybrid family's "G" layers
                out.append((loss, fam, lay, VerifyConfig(model=model, pattern=pattern, loss=name,
                                                         loss_agg=agg or "token-mean", **kw)))
    return out


def main() -> None:
    from megatron_tree.training.verify import run_verify_many

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--tolerance", type=float, default=1e-12)
    args = ap.parse_args()
    t0 = time.time()
    groups: dict = {}  # one set of rank processes per (world size, family); a group that raises runs config by config
    for item in _configs(args.losses, args.families, args.layouts, args.tolerance):
        groups.setdefault((item[-1].world_size, item[1]), []).append(item)
    worst: dict = {}
    failed = 0

    def report(loss, fam, lay, out):
        nonlocal failed
        errors = {k: v for k, v in out.items() if k in ("logits", "loss", "grads", "params_after_step")}
        judged = max(errors.get("loss", 0.0), errors.get("grads", 0.0))
        worst[loss] = max(worst.get(loss, 0.0), judged)
        ok = out["passed"] and judged <= args.tolerance
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {loss} {fam} [{lay}]: "
              + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)

    for items in groups.values():
        try:
            outs = run_verify_many([c for *_, c in items], timeout=3600)
        except Exception:  # noqa: BLE001 - find and name the config that raised
            outs = None
        for j, (loss, fam, lay, cfg) in enumerate(items):
            if outs is not None:
                report(loss, fam, lay, outs[j])
                continue
            try:
                report(loss, fam, lay, run_verify_many([cfg], timeout=3600)[0])
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"ERROR {loss} {fam} [{lay}]: {str(e).strip().splitlines()[-1]}", flush=True)
    for loss, err in worst.items():
        print(f"{loss}: worst loss / gradient error {err:.1e} over {len(args.families)} families x "
              f"{len(args.layouts)} layouts")
    print(f"{failed} failed, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
