"""``docs/run-directory.md`` written from the models: every file of a run directory, every key, its type and what
it means (units in the key's name or its description).

    python -m kvcap.rundir.doc > docs/run-directory.md

Why generated: the models are the contract; a page written by hand drifts from them, and a test
(tests/unit/test_rundir_models.py) fails when the committed page is not what this prints.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel

from kvcap.rundir import RequestRecord
from kvcap.rundir.compare import Comparison
from kvcap.rundir.levels import LevelRow
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.search import PointRow, SearchResult
from kvcap.rundir.summary import Summary
from kvcap.specs.calibration import CalibrationSection

RECORD_FIELDS: dict[str, str] = {
    "mode": "load model of its level: 'concurrency', 'rate' or 'trace'",
    "level": "its level's load (concurrency, requests/s or trace speed)",
    "repeat": "its repeat (0-based)",
    "phase": "'warmup' or 'measure' (sent inside the measured window)",
    "worker": "the client worker that sent it",
    "index": "its index within the worker's level",
    "start_s": "when it was sent (run seconds; latencies count from it)",
    "end_s": "when it ended (run seconds), None if it never did",
    "send_delay_ms": "how late it was sent against its schedule (ms)",
    "ok": "it succeeded",
    "error": "its error class ('http_4xx', 'timeout', 'cancelled'...), None when ok",
    "status": "HTTP status, None without a response",
    "input_tokens": "prompt tokens (the server's usage count when it gave one)",
    "output_tokens": "output tokens received",
    "requested_output_tokens": "output tokens asked for",
    "tokens_source": "where the token counts came from ('usage', 'tokenizer', 'chunks'...)",
    "ttft_ms": "time to first token (ms)",
    "tpot_ms": "time per output token after the first: (e2e − ttft) / (output_tokens − 1) (ms)",
    "e2e_ms": "end-to-end latency (ms)",
    "itl_ms": "each gap between output tokens (ms)",
    "queue_ms": "time queued at the server before its prefill (ms; sim, or a server that reports it)",
    "finish_reason": "the server's finish reason",
    "truncated": "ended short of the output asked",
    "early_stop": "ended by a stop token before the output asked",
    "retries": "retries before this attempt",
    "group": "its prefix group (shared prompt prefixes), None without one",
    "error_detail": "the error's text",
    "text": "the generated text (bench --keep-text)",
    "replica": "sim: the replica that served it",
    "preemptions": "sim: times it was preempted",
    "recomputed_tokens": "sim: tokens recomputed after preemption",
    "parked_ms": "sim: time parked in a lower KV tier (ms)",
    "copy_ms": "sim: time copying its KV between tiers (ms)",
    "prefix_hit_tokens": "sim: prompt tokens found in the prefix cache",
    "tier_hit_tokens": "sim: prompt tokens found in a lower KV tier",
    "cached_tokens": "bench: prompt tokens the server says it served from its cache, HBM and any connector tier "
                     "together (usage.prompt_tokens_details.cached_tokens, else llama.cpp's timings.cache_n); None "
                     "when it did not say (vLLM without --enable-prompt-tokens-details, or with it and nothing "
                     "found); absent from older runs",
    "session": "multi-turn workloads: the session it belongs to",
    "turn": "multi-turn workloads: its turn within the session (1 for the first)",
}
"""``requests.jsonl``'s keys: the record is a TypedDict (the hot path), so its descriptions live here."""

TELEMETRY_FIELDS = (
    ("t_s", "number", "sample time (run seconds)"),
    ("source", "string", "where it came from ('metrics:URL', 'prometheus', 'sim', 'nvml'...)"),
    ("name", "string", "the series, e.g. 'server.requests_running', 'gpu.util', 'net.rx_bytes_s'"),
    ("labels", "object", "the series' labels (node, replica, model_name, gpu...)"),
    ("value", "number", "the sample (units in the name: _bytes, _s, a fraction for util/usage)"),
)


def type_name(annotation: Any) -> str:
    """An annotation as the page writes it: ``number``, ``string | null``, ``list[number]``, a model's name."""
    origin = get_origin(annotation)
    if origin is Annotated:  # constraints (a pair's length) are the description's to say
        return type_name(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        names = list(dict.fromkeys(type_name(a) for a in get_args(annotation)))
        return " | ".join(names)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(annotation))
    if origin is list:
        return f"list[{type_name(get_args(annotation)[0])}]"
    if origin is dict:
        key, value = get_args(annotation)
        return f"object[{type_name(key)} → {type_name(value)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null",
            Any: "any"}.get(annotation, str(annotation))


def _cell(text: str) -> str:
    """Text for a table cell: a ``|`` escaped."""
    return text.replace("|", "\\|")


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds (through unions, lists and dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in nested_models(a)]


def model_section(model: type[BaseModel], seen: set[type[BaseModel]], level: int = 3) -> list[str]:
    """A model's table, then each model it holds (once per page)."""
    seen.add(model)
    doc = (model.__doc__ or "").strip()
    out = [f"{'#' * level} {model.__name__}", "", doc, "", "| key | type | description |", "|---|---|---|"]
    inner: list[type[BaseModel]] = []
    for name, field in model.model_fields.items():
        if field.exclude:  # held in memory, never written
            continue
        required = "" if field.is_required() else " (optional)"
        out.append(f"| `{name}` | {_cell(type_name(field.annotation))}{required} | {_cell(field.description or '')} |")
        inner += [m for m in nested_models(field.annotation) if m not in seen and m not in inner]
    out.append("")
    for m in inner:
        if m not in seen:
            out += model_section(m, seen, level)
    return out


def record_section() -> list[str]:
    hints = typing.get_type_hints(RequestRecord)
    required = RequestRecord.__required_keys__
    out = ["| key | type | description |", "|---|---|---|"]
    for name, hint in hints.items():
        opt = "" if name in required else " (optional)"
        out.append(f"| `{name}` | {_cell(type_name(hint))}{opt} | {_cell(RECORD_FIELDS.get(name, ''))} |")
    return out


def _module_doc(model: type[BaseModel]) -> str:
    return (sys.modules[model.__module__].__doc__ or "").strip()


def render() -> str:
    """The whole page."""
    seen: set[type[BaseModel]] = set()
    out = ["# The run directory", "",
           "<!-- generated by `python -m kvcap.rundir.doc > docs/run-directory.md`: edit the models, not this page -->",
           "",
           "What `kvcap bench` and `kvcap sim` write, and everything downstream (`analyze`, `report`, `compare`, "
           "`calibrate`, `search`) reads. The models in `kvcap/rundir/` are the contract; this page is printed "
           "from them. Optional keys are absent from the file when the writer had nothing to say; a key shown "
           "with `null` in its type is written as `null`.",
           "",
           "| file | what |", "|---|---|",
           "| `manifest.json` | the fixed variables and where, when and against what the run ran "
           "([Manifest](#manifest)) |",
           "| `requests.jsonl` | one line per finished request, appended as each finishes "
           "([requests.jsonl](#requestsjsonl)) |",
           "| `levels.jsonl` | one line per level repeat: its windows and achieved load ([LevelRow](#levelrow)) |",
           "| `telemetry.jsonl` | samples of the server's, GPU's, host's and network's series "
           "([telemetry.jsonl](#telemetryjsonl)) |",
           "| `summary.json` | the analysis: per-level statistics, conditions, capacities, diagnosis "
           "([Summary](#summary)) |",
           "| `requests.columns`, `telemetry.columns` (+ `.columns.json`) | binary column copies of the two JSONL "
           "files the analysis reads instead of parsing them; stale (and deleted) once those change |",
           "",
           "A killed writer leaves at most a torn last line in a JSONL file; readers skip it.", "",
           "## manifest.json", ""]
    out += model_section(Manifest, seen)
    out += ["## requests.jsonl", "",
            "One JSON object per line (`kvcap.rundir.RequestRecord`, a TypedDict: records are the hot path).", ""]
    out += record_section()
    out += ["", "## levels.jsonl", "",
            "One JSON object per line; a recorder may add keys of its own diagnosis (kept, not judged).", ""]
    out += model_section(LevelRow, seen)
    out += ["## telemetry.jsonl", "", "One sample per line.", "", "| key | type | description |", "|---|---|---|"]
    out += [f"| `{k}` | {t} | {d} |" for k, t, d in TELEMETRY_FIELDS]
    out += ["", "## summary.json", ""]
    out += model_section(Summary, seen)
    out += ["## compare.json", "",
            "`kvcap compare --json` prints it; `kvcap ab` writes it beside the arms' run directories. "
            + " ".join([*_module_doc(Comparison).split("\n\n"), ""][1].split()), ""]
    out += model_section(Comparison, seen)
    out += ["## A search directory: points.jsonl and search.json", "", " ".join(_module_doc(PointRow).split()), ""]
    out += model_section(PointRow, seen)
    out += model_section(SearchResult, seen)
    out += ["## A scenario's calibration: section", "", " ".join(_module_doc(CalibrationSection).split()), ""]
    out += model_section(CalibrationSection, seen)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
