#!/usr/bin/env python3
"""Re-fit kvcap/sim/calibration/a100.yaml from Vidur's measured A100 kernel and all-reduce timings.

What is fitted (docs/cost-model.md explains why these forms):
  GEMMs         per op: max(FLOPs(T') / (peak·e_c), bytes(T) / (bw·e_m)) + c0, T' = T rounded up to a
                multiple of the tile once past one tile
                over QKV, O, gate+up, down of Llama-3-8B and Llama-2-7B at TP 1, 2, 4, 8 (all num_tokens rows);
                least squares on log(predicted / measured); the tile is chosen from a few candidates.
  elementwise   per op: max(bytes(T) / (bw·e_elem), floor) over both norms, rotary, SiLU-and-mul, add.
  all-reduce    2 GPUs over NVLink: latency + size / (NVLink per-direction bandwidth · efficiency);
                the 4-GPU rows (pairwise NVLink: the ring crosses PCIe) are only checked against the
                pcie4-x16 link preset, not fitted.
The operator shapes and byte counts come from kvcap.sim.cost (dense_layer_ops, elementwise_layer_ops), so
the fit and the cost model cannot disagree about them.

Usage:
  scripts/calibrate_cost_model.py                 # fit and rewrite the YAML
  scripts/calibrate_cost_model.py --check         # fit and fail if the YAML's numbers differ
  scripts/calibrate_cost_model.py --markdown      # also print the error tables for docs/cost-model.md
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcap.sim.calibration_io import Calibration  # noqa: E402
from kvcap.sim.cost import CostModel  # noqa: E402
from kvcap.sim.model_shape import dense_layer_ops, elementwise_layer_ops  # noqa: E402
from kvcap.sim.roofline import all_reduce_time, default_tp_link, gemm_peak_flops  # noqa: E402
from kvcap.specs.hardware import load_gpu, load_link  # noqa: E402
from kvcap.specs.model import ModelSpec, model_from_config  # noqa: E402

DATA = ROOT / "data" / "vidur"
OUT = ROOT / "kvcap" / "sim" / "calibration" / "a100.yaml"
MODELS = ("Meta-Llama-3-8B", "Llama-2-7b-hf")
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEM_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
TILES = (1, 32, 64, 128, 256)
GPU = "a100-80gb"
NVLINK_HOP_S = 1e-6  # default_tp_link's per-hop latency; the fit's latency is the rest
SIG = 4  # significant digits kept in the YAML


def sig(x: float, digits: int = SIG) -> float:
    return float(f"{x:.{digits}g}")


# ----------------------------------------------------------------------------------------------------- data


def read_mlp(path: Path) -> tuple[ModelSpec, dict[tuple[int, int], dict[str, float]]]:
    """Per (num_tokens, tp): each op's median ms, averaged over the few duplicated rows; and the shape."""
    groups: dict[tuple[int, int], list[dict[str, str]]] = defaultdict(list)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        groups[(int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))].append(r)
    r0 = rows[0]
    if r0["use_gated_mlp"] != "True":
        raise SystemExit(f"{path}: only gated MLPs are modelled")
    spec = model_from_config({"model_type": "llama", "hidden_size": int(r0["n_embd"]),
                              "intermediate_size": int(r0["n_expanded_embd"]),
                              "num_attention_heads": int(r0["n_head"]), "num_key_value_heads": int(r0["n_kv_head"]),
                              "num_hidden_layers": 32, "vocab_size": int(r0["vocab_size"])},
                             name=path.parent.name, source=str(path))
    table = {key: {op: float(np.mean([float(x[f"time_stats.{op}.median"]) for x in rs])) * 1e-3
                   for op in GEMM_OPS + ELEM_OPS}
             for key, rs in sorted(groups.items())}
    return spec, table


def read_all_reduce(path: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per worker count: (bytes, median seconds), exact duplicate rows dropped (as Vidur does)."""
    seen: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with path.open() as f:
        for r in csv.DictReader(f):
            if r["collective"] == "all_reduce":
                seen[int(r["num_workers"])][int(r["size"])].append(float(r["time_stats.all_reduce.median"]))
    out = {}
    for w, by_size in seen.items():
        sizes = np.array(sorted(by_size), dtype=float)
        out[w] = (sizes, np.array([np.mean(by_size[int(s)]) for s in sizes]) * 1e-3)
    return out


# ------------------------------------------------------------------------------------------------- fitting


def nelder_mead(f: Callable[[np.ndarray], float], x0: list[float], iters: int = 4000,
                step: float = 0.2) -> np.ndarray:
    """Minimise f from x0 (plain Nelder-Mead; the problems here have 2-3 smooth-enough parameters)."""
    n = len(x0)
    simplex = np.array([x0] + [np.array(x0) + step * np.eye(n)[i] for i in range(n)], dtype=float)
    values = np.array([f(x) for x in simplex])
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        centre = simplex[:-1].mean(axis=0)
        reflected = centre + (centre - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centre + 2 * (centre - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centre + 0.5 * (simplex[-1] - centre)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
                values[1:] = [f(x) for x in simplex[1:]]
        if np.ptp(values) < 1e-12:
            break
    return simplex[np.argmin(values)]


def best_fit(loss: Callable[[np.ndarray], float], starts: list[list[float]]) -> np.ndarray:
    fits = [nelder_mead(loss, s) for s in starts]
    return min(fits, key=loss)


class Rows:
    """Flat per-op arrays over every (model, tp, num_tokens) row."""

    def __init__(self, specs: dict[str, ModelSpec], tables: dict[str, dict[tuple[int, int], dict[str, float]]]):
        g: dict[str, list] = defaultdict(list)
        e: dict[str, list] = defaultdict(list)
        for name, table in tables.items():
            spec = specs[name]
            for tp in sorted({tp for _, tp in table}):
                gops = dense_layer_ops(spec, tp)
                eops = elementwise_layer_ops(spec, tp)
                for (tokens, tp2), times in table.items():
                    if tp2 != tp:
                        continue
                    for op in gops:
                        g["key"].append((name, tp, tokens))
                        g["t"].append(tokens)
                        g["flops_per_token"].append(op.flops_per_token)
                        g["weight"].append(op.weight_bytes)
                        g["act"].append(op.act_bytes_per_token)
                        g["y"].append(times[op.name])
                    for op in eops:
                        e["key"].append((name, tp, tokens))
                        e["t"].append(tokens)
                        e["bytes"].append(op.bytes_per_token)
                        e["y"].append(times[op.name])
        self.g = {k: (np.array(v, dtype=float) if k != "key" else v) for k, v in g.items()}
        self.e = {k: (np.array(v, dtype=float) if k != "key" else v) for k, v in e.items()}


def gemm_pred(r: dict, peak: float, bw: float, tile: int, ec: float, em: float, c0: float) -> np.ndarray:
    tt = np.where(r["t"] <= tile, r["t"], np.ceil(r["t"] / tile) * tile)
    return np.maximum(r["flops_per_token"] * tt / (peak * ec), (r["weight"] + r["act"] * r["t"]) / (bw * em)) + c0


def elem_pred(r: dict, bw: float, ee: float, floor: float) -> np.ndarray:
    return np.maximum(r["bytes"] * r["t"] / (bw * ee), floor)


def per_layer(keys: list, pred: np.ndarray, meas: np.ndarray) -> dict[tuple, tuple[float, float]]:
    out: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k, p, m in zip(keys, pred, meas):
        out[k][0] += p
        out[k][1] += m
    return {k: (v[0], v[1]) for k, v in out.items()}


def summarise(errors: list[float]) -> dict[str, float]:
    a = np.abs(np.array(errors))
    return {"median": sig(float(np.median(a)), 3), "max": sig(float(a.max()), 3)}


# ---------------------------------------------------------------------------------------------------- main


def fit(data: Path) -> tuple[dict, dict]:
    gpu = load_gpu(GPU)
    peak, bw = gemm_peak_flops(gpu, "bf16"), gpu.memory_bandwidth_bytes_s
    specs, tables = {}, {}
    for name in MODELS:
        specs[name], tables[name] = read_mlp(data / "a100" / "meta-llama" / name / "mlp.csv")
    rows = Rows(specs, tables)
    g, e = rows.g, rows.e

    # GEMMs: search the tile, fit (e_c, e_m, c0) in log space for each
    tile_loss, tile_fit = {}, {}
    for tile in TILES:
        def loss(x: np.ndarray, tile: int = tile) -> float:
            ec, em, c0 = np.exp(x)
            if ec > 1 or em > 1:
                return 1e9
            return float(np.sum(np.log(gemm_pred(g, peak, bw, tile, ec, em, c0) / g["y"]) ** 2))
        x = best_fit(loss, [[math.log(0.7), math.log(0.8), math.log(5e-6)],
                            [math.log(0.8), math.log(0.7), math.log(2e-6)],
                            [math.log(0.6), math.log(0.9), math.log(1e-5)]])
        tile_loss[tile], tile_fit[tile] = loss(x), np.exp(x)
    tile = min(tile_loss, key=lambda k: tile_loss[k])
    ec, em, c0 = (sig(v) for v in tile_fit[tile])

    def eloss(x: np.ndarray) -> float:
        ee, floor = np.exp(x)
        if ee > 1:
            return 1e9
        return float(np.sum(np.log(elem_pred(e, bw, ee, floor) / e["y"]) ** 2))
    ee, floor = (sig(v) for v in np.exp(best_fit(eloss, [[math.log(0.5), math.log(4e-6)],
                                                         [math.log(0.3), math.log(2e-6)]])))

    # all-reduce: fit 2 GPUs over NVLink; check 4 GPUs (pairwise NVLink, the ring crosses PCIe)
    ar = read_all_reduce(data / "network" / "a100_pairwise_nvlink" / "all_reduce.csv")
    sizes, times = ar[2]
    nv_dir = gpu.nvlink_bytes_s / 2

    def arloss(x: np.ndarray) -> float:
        alpha, eff = np.exp(x)
        if eff > 1:
            return 1e9
        return float(np.sum(np.log((alpha + sizes / (nv_dir * eff)) / times) ** 2))
    alpha, nv_eff = np.exp(best_fit(arloss, [[math.log(5e-5), math.log(0.6)], [math.log(1e-5), math.log(0.3)]]))
    ar_latency, nv_eff = sig(alpha - 2 * NVLINK_HOP_S), sig(nv_eff)

    calib = Calibration(gpu=GPU, compute_efficiency=ec, memory_efficiency=em, gemm_op_overhead_s=c0,
                        gemm_token_tile=tile, elementwise_efficiency=ee, elementwise_op_floor_s=floor,
                        all_reduce_latency_s=ar_latency, nvlink_efficiency=nv_eff)
    nvlink, pcie = default_tp_link(gpu, calib), load_link("pcie4-x16")
    def ar_summary(workers: int, link) -> dict:
        sizes, times = ar[workers]
        err = np.array([all_reduce_time(s, workers, link, calib) / t - 1 for s, t in zip(sizes, times)])
        small = sizes < 2**20
        return {"rows": len(sizes), "all": summarise(list(err)), "below_1MiB": summarise(list(err[small])),
                "from_1MiB": summarise(list(err[~small]))}

    ar_err = {"tp2_nvlink": ar_summary(2, nvlink), "tp4_pairwise_nvlink_as_pcie4": ar_summary(4, pcie)}

    # errors with the rounded numbers, per model and tp, of the per-layer sums
    gl = per_layer(g["key"], gemm_pred(g, peak, bw, tile, ec, em, c0), g["y"])
    el = per_layer(e["key"], elem_pred(e, bw, ee, floor), e["y"])
    errors: dict[str, dict] = {}
    at: dict[str, dict] = {}
    for name in MODELS:
        errors[name] = {}
        for tp in (1, 2, 4, 8):
            keys = [k for k in gl if k[0] == name and k[1] == tp]
            errors[name][f"tp{tp}"] = {
                "rows": len(keys),
                "gemm": summarise([gl[k][0] / gl[k][1] - 1 for k in keys]),
                "elementwise": summarise([el[k][0] / el[k][1] - 1 for k in keys]),
                "layer": summarise([(gl[k][0] + el[k][0]) / (gl[k][1] + el[k][1]) - 1 for k in keys]),
            }
        at[name] = {f"t{t}": {"measured_ms": sig(gl[(name, 1, t)][1] * 1e3, 4),
                              "model_ms": sig(gl[(name, 1, t)][0] * 1e3, 4),
                              "error": sig(gl[(name, 1, t)][0] / gl[(name, 1, t)][1] - 1, 3)}
                    for t in (1, 64, 512, 4096) if (name, 1, t) in gl}

    # the cost model itself must give what the vectorised fit gives (same shapes, same formula)
    for name in MODELS:
        for tp in (1, 8):
            cm = CostModel(specs[name], gpu, tp=tp, calib=calib)
            for t in (1, 104, 4096):
                gm, em_ = cm.layer_times(t)
                assert abs(gm / gl[(name, tp, t)][0] - 1) < 1e-9, (name, tp, t)
                assert abs(em_ / el[(name, tp, t)][0] - 1) < 1e-9, (name, tp, t)

    fields = {
        "compute_efficiency": ec, "memory_efficiency": em, "gemm_op_overhead_s": c0, "gemm_token_tile": tile,
        "elementwise_efficiency": ee, "elementwise_op_floor_s": floor,
        "all_reduce_latency_s": ar_latency, "nvlink_efficiency": nv_eff,
    }
    fit_info = {
        "data": "microsoft/vidur 7d47513: data/profiling/compute/a100/meta-llama/{Meta-Llama-3-8B,Llama-2-7b-hf}/"
                "mlp.csv, data/profiling/network/a100_pairwise_nvlink/all_reduce.csv (MIT)",
        "nominal": {"gpu": GPU, "peak_flops": peak, "memory_bandwidth_bytes_s": bw,
                    "nvlink_bytes_s_per_direction": nv_dir},
        "gemm_tile_search": {f"tile{t}": {"loss": sig(tile_loss[t], 4),
                                          "e_c": sig(tile_fit[t][0], 3), "e_m": sig(tile_fit[t][1], 3),
                                          "c0_s": sig(tile_fit[t][2], 3)} for t in TILES},
        "errors": errors,
        "llama3_8b_tp1_gemm_per_layer": at["Meta-Llama-3-8B"],
        "llama2_7b_tp1_gemm_per_layer": at["Llama-2-7b-hf"],
        "all_reduce": {**ar_err, "fitted_latency_s": sig(float(alpha)), "hop_latency_s": NVLINK_HOP_S},
    }
    return fields, fit_info


HEADER = """\
# Cost-model calibration for the NVIDIA A100 (kvcap.sim.cost). DATA, written by
# scripts/calibrate_cost_model.py from Vidur's measured kernel timings: do not edit by hand, re-run the script.
#
# Efficiencies are relative to the a100-80gb preset's nominal numbers (312 TFLOP/s dense BF16,
# 2,039 GB/s HBM, NVLink 300 GB/s per direction). Vidur's A100 node is `a100_pairwise_nvlink` (4 GPUs,
# NVLink between pairs only), so the fitted efficiencies fold in whatever part and clocks it ran.
#
#   compute_efficiency (e_c), memory_efficiency (e_m), gemm_op_overhead_s (c0), gemm_token_tile:
#       GEMM op time = max(FLOPs(tokens, rounded up to whole tiles past the first) / (peak*e_c),
#                          bytes / (bw*e_m)) + c0
#   elementwise_efficiency, elementwise_op_floor_s:
#       elementwise op time = max(bytes / (bw*e_elem), floor)
#   attention_*: not measured (Vidur's attention kernels are not in the data) -> null = the GEMM values
#   step_overhead_s: CPU-side per-step cost, not in kernel data -> 0
#   all_reduce_latency_s, nvlink_efficiency: ring all-reduce, fitted on 2-GPU NVLink all-reduces
#
# fit.errors: |predicted/measured - 1| of the per-layer time (sum of the 4 GEMMs; of the 5 elementwise ops;
# of both), median and max over the num_tokens rows, per model and TP. See docs/cost-model.md.
"""


def render(fields: dict, fit_info: dict) -> str:
    doc = {
        "gpu": GPU,
        "applies_to": ["a100-80gb", "a100-40gb"],
        "source": "fitted by scripts/calibrate_cost_model.py on Vidur A100 kernel timings (see fit.data)",
        **fields,
        "attention_compute_efficiency": None,
        "attention_memory_efficiency": None,
        "attention_op_overhead_s": None,
        "step_overhead_s": 0.0,
        "fit": fit_info,
    }
    return HEADER + "\n" + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=110)


def markdown(fit_info: dict) -> str:
    lines = ["| model | TP | rows | GEMM median | GEMM max | elementwise median | elementwise max | layer median "
             "| layer max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, per_tp in fit_info["errors"].items():
        for tp, v in per_tp.items():
            lines.append(f"| {name} | {tp[2:]} | {v['rows']} | {v['gemm']['median']:.1%} | {v['gemm']['max']:.1%} | "
                         f"{v['elementwise']['median']:.1%} | {v['elementwise']['max']:.1%} | "
                         f"{v['layer']['median']:.1%} | {v['layer']['max']:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help="the vidur/ folder (default: data/vidur in the repository)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the file's fitted numbers differ")
    ap.add_argument("--markdown", action="store_true", help="print the error table as Markdown")
    args = ap.parse_args(argv)
    fields, fit_info = fit(args.data)
    for k, v in fields.items():
        print(f"{k:24s} {v}")
    if args.markdown:
        print(markdown(fit_info))
    if args.check:
        current = yaml.safe_load(args.out.read_text())
        bad = {k: (current.get(k), v) for k, v in fields.items()
               if not isinstance(current.get(k), (int, float)) or not math.isclose(current[k], v, rel_tol=1e-3)}
        if bad:
            print(f"{args.out} is stale: {bad}", file=sys.stderr)
            return 1
        print(f"{args.out} matches the data")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(fields, fit_info))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
