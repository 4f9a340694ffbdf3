"""Which grammar engine: llguidance (what multilora uses) against outlines-core, on the embedded
SmolLM2-135M-Instruct tokenizer (49,152 tokens). For each constraint: the time to compile it for
this vocabulary (outlines-core builds a regex index over the whole vocabulary; llguidance
compiles lazily), then the mean time of one token's mask along a valid output (mask, then
advance by that token), medians of --repeats. xgrammar is not measured: it requires torch,
transformers and triton at run time, which multilora does not take.

    pip install outlines-core==0.2.14 --no-deps    # the comparison only; not a dependency
    python benchmarks/grammar_engines.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.common import machine_info, median, save_json  # noqa: E402

OBJECT = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}
OBJECT_TEXT = '{"name":"Ada Lovelace","age":36,"city":"London","tags":["math","poetry"]}'
CASES = [("object schema", "json", OBJECT, OBJECT_TEXT),
         ("date regex", "regex", r"\d{4}-\d{2}-\d{2}( [a-z]+){0,6}", "2026-12-02 a day in the life of"),]


def _byte_decoder():
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def outlines_vocabulary(tok, eos: int):
    import outlines_core as oc
    dec = _byte_decoder()
    vocab: dict = {}
    special = set(tok._tok.get_added_tokens_decoder()) if hasattr(tok._tok, "get_added_tokens_decoder") else set()
    for text, i in tok._tok.get_vocab().items():
        if i == eos or i in special:
            continue
        raw = bytes(dec[c] for c in text) if all(c in dec for c in text) else text.encode()
        vocab.setdefault(raw, []).append(i)
    return oc.Vocabulary(eos, vocab)


def run_llguidance(grammars, kind, spec, ids):
    from multilora.engine.structured import StructuredOutput, allow_all
    so = StructuredOutput.json_schema(spec) if kind == "json" else StructuredOutput("regex", spec)
    t0 = time.perf_counter()
    grammars._compiled.clear()
    m = grammars.matcher(so)
    compile_s = time.perf_counter() - t0
    mask = allow_all(1, grammars.vocab_size)
    t0 = time.perf_counter()
    for t in ids:
        grammars.fill([(m, 0)], mask)
        assert (mask[0, t // 32] >> (t % 32)) & 1, "llguidance refused a token of the valid text"
        assert m.consume_token(t)
    return compile_s, (time.perf_counter() - t0) / len(ids)


def run_outlines(vocab, kind, spec, ids, vocab_size):
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec
    guide = oc.Guide(oc.Index(regex, vocab))
    compile_s = time.perf_counter() - t0
    mask = np.zeros((vocab_size + 31) // 32, np.int32)
    t0 = time.perf_counter()
    for t in ids:
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        assert (mask[t // 32] >> (t % 32)) & 1, "outlines-core refused a token of the valid text"
        guide.advance(t, return_tokens=False)
    return compile_s, (time.perf_counter() - t0) / len(ids)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from multilora.engine.structured import Grammars
    from multilora.engine.tokenizer import load_tokenizer
    from multilora.default_model import default_model_dir
    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    eos = 2
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tok.to_json, vocab_size, [eos])
    t0 = time.perf_counter()
    grammars._tokenizer()
    llg_tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    vocab = outlines_vocabulary(tok, eos)
    oc_vocab_s = time.perf_counter() - t0
    print(f"tokenizer set-up: llguidance {llg_tok_s:.2f} s, outlines-core vocabulary {oc_vocab_s:.2f} s")
    rows = []
    for label, kind, spec, text in CASES:
        ids = tok.encode(text, add_special_tokens=False)
        res = {"llguidance": [], "outlines-core": []}
        for _ in range(args.repeats):
            res["llguidance"].append(run_llguidance(grammars, kind, spec, ids))
            res["outlines-core"].append(run_outlines(vocab, kind, spec, ids, vocab_size))
        for engine, vals in res.items():
            row = dict(case=label, engine=engine, tokens=len(ids), compile_ms=1e3 * median([v[0] for v in vals]),
                       mask_us_per_token=1e6 * median([v[1] for v in vals]))
            rows.append(row)
            print(f"{label:14s} {engine:13s}: compile {row['compile_ms']:9.1f} ms, "
                  f"{row['mask_us_per_token']:8.1f} us per token's mask ({len(ids)} tokens)", flush=True)
    print("\n| constraint | engine | compile (ms) | mask + advance per token (us) |")
    print("|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['engine']} | {r['compile_ms']:.1f} | {r['mask_us_per_token']:.1f} |")
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args=vars(args), tokenizer_setup_s=dict(
            llguidance=llg_tok_s, outlines_core=oc_vocab_s), rows=rows))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
