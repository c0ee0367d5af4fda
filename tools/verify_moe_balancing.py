"""The MoE balancing acceptance matrix of `megatron-tree verify`, float64, in one run: every balancing type
(aux_loss, seq_aux_loss, global_aux_loss) with z-loss and sigmoid expert bias on every model family, the
parallel layouts, carry, and N Adam steps. Prints one line per config with every metric's max relative
error against stock flat training (the tolerance given).

    python tools/verify_moe_balancing.py [models|layouts|steps|all] [--tolerance 1e-12]
"""
from __future__ import annotations

import argparse
import time


def _configs(which: str, tol: float) -> list:
    from megatron_tree.training.verify import VerifyConfig

    base = dict(moe_aux_loss_coeff=1e-1, moe_z_loss_coeff=1e-2, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=1e-3, moe_router_score_function="sigmoid")
    types = ("aux_loss", "seq_aux_loss", "global_aux_loss")
    bal = lambda t, **kw: dict(base, moe_router_load_balancing_type=t, **kw)  # noqa: E731
    out = []
    if which in ("models", "all"):
        for model, pattern in (("hybrid", "MG*E"), ("mamba", None), ("qwen3next", None), ("mla", None), ("dsa", None)):
            out += [VerifyConfig(model=model, pattern=pattern, balancing=bal(t), tolerance=tol) for t in types]
        out.append(VerifyConfig(model="gpt", tolerance=tol, balancing=bal(
            "aux_loss", moe_router_score_function="softmax", moe_router_enable_expert_bias=False)))
    if which in ("layouts", "all"):
        for t in types:
            out += [VerifyConfig(model="hybrid", pattern="MG*E", tp=2, sp=True, balancing=bal(t), tolerance=tol),
                    VerifyConfig(model="gpt", ep=2, dp=2, balancing=bal(t), tolerance=tol),
                    VerifyConfig(model="gpt", cp=2, balancing=bal(t), tolerance=tol),
                    VerifyConfig(model="gpt", pp=2, balancing=bal(t), tolerance=tol)]
        z_and_bias = {k: v for k, v in base.items() if k != "moe_aux_loss_coeff"}  # aux losses refuse carry
        out += [VerifyConfig(model=m, pattern=p, balancing=dict(z_and_bias), carry=True, budget=32, tolerance=tol)
                for m, p in (("hybrid", "MG*E"), ("gpt", None))]
    if which in ("steps", "all"):
        out += [VerifyConfig(model=m, pattern=p, balancing=bal(t), steps=10, optimizer="adam", tolerance=1e-10)
                for m, p, t in (("gpt", None, "aux_loss"), ("hybrid", "MG*E", "global_aux_loss"),
                                ("qwen3next", None, "aux_loss"))]
    return out


def main() -> None:
    from megatron_tree.training.verify import run_verify_many

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", nargs="?", default="all", choices=("models", "layouts", "steps", "all"))
    ap.add_argument("--tolerance", type=float, default=1e-12)
    args = ap.parse_args()
    t0 = time.time()
    by_world: dict = {}
    for cfg in _configs(args.which, args.tolerance):
        by_world.setdefault(cfg.world_size, []).append(cfg)
    for cfgs in by_world.values():
        for cfg, out in zip(cfgs, run_verify_many(cfgs, timeout=1800)):
            errors = {k: v for k, v in out.items() if isinstance(v, float) and not k.endswith("_at")
                      and k not in ("tolerance", "loss_value")}
            layout = (f"tp{cfg.tp}{'+sp' if cfg.sp else ''} ep{cfg.ep} dp{cfg.dp} cp{cfg.cp} pp{cfg.pp}"
                      f"{' carry' if cfg.carry else ''}{f' {cfg.steps} steps' if cfg.steps > 1 else ''}")
            kind = cfg.balancing.get("moe_router_load_balancing_type") if "moe_aux_loss_coeff" in cfg.balancing \
                else "z-loss + expert bias"
            print(f"{'PASS' if out['passed'] else 'FAIL'} {cfg.model}{f' {cfg.pattern}' if cfg.pattern else ''} "
                  f"[{layout}] {kind} (tol {cfg.tolerance:g}): "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
