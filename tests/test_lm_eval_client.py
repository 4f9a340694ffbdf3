"""EleutherAI's lm-evaluation-harness against the server: its own API clients, `local-completions`
and `local-chat-completions` (lm_eval.models.openai_completions), built from a `--model_args`
string as its command line builds them and pointed at a uvicorn server in this process over a
tiny random Llama with two PEFT adapters; their answers compared with transformers + PEFT at
float32.

The real client classes are driven, not copies of their payloads: lm-eval is a test dependency
(pyproject's `test` extra), so that a change in what a later lm-eval sends or how it parses the
answer (echo, logprobs, token-id prompts, several prompts in one request, the stop list) fails
here. It adds about 90 s and 470 MB to CI's install (its datasets, pandas, pyarrow, scikit-learn),
which CI's time allows.

What lm-eval's requests are, and what each must equal:
- loglikelihood (context, continuation): `/v1/completions` with the prompts as token ids,
  `echo: true`, `logprobs: 1`, `max_tokens: 1`, `temperature: 0`; lm-eval sums the echoed
  `token_logprobs` over the continuation (all but the last token, the generated one: also when
  that one is the EOS) and calls it greedy when each continuation token's logprob is the top
  one. Equal to transformers + PEFT's log P(continuation | context) within LOGLIK_ATOL nats, and
  `is_greedy` equal to the reference's argmax test; contexts split as lm-eval's `hf` backend
  splits them (trailing spaces to the continuation; an empty context is the prefix token).
- loglikelihood_rolling (perplexity tasks): the same requests over the whole text.
- generate_until on `/v1/completions` (token ids, `stop` = `until` plus the EOS text) and on
  `/v1/chat/completions` (messages, `stop` = `until`): the text equals the reference's greedy
  decode up to the EOS, cut before the first stop string (the server applies the stop list;
  lm-eval takes the text as it comes).
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from lm_eval.api.instance import Instance   # a test dependency, not skipped without it: see above
from lm_eval.api.registry import get_model
from lm_eval.models.api_models import JsonChatStr

from tests import reference
from tests.test_server import API_KEY, Served, serve_in_thread

MAX_MODEL_LEN = 128
# names that are no substring of a module path (PEFT warns of keys "missing" otherwise)
ADAPTERS = {"all_r8": "a_all_r8", "attn_r4": "b_attn_r4_rslora"}
EOS = 2                       # <|im_end|>, the tiny tokenizer's EOS (and lm-eval's prefix token)
LOGLIK_ATOL = 1e-4            # nats, on a sum of float32 logprobs (measured: at most 2e-6)
MAX_GEN = 10

LOGLIK_PAIRS = [  # (context, continuation) as a task gives them
    ("the quick brown fox", " jumps over the lazy dog"),
    ("hello world, how are you", " today?"),
    ("once upon a time there was a little ", "model that served"),   # the space moves over
    ("many small requests share one batch;", " each names its adapter or none."),
    ("", "tell me a story about cats"),                                # the prefix token as context
]
GEN_PROMPTS = ["once upon a time there was", "tell me a story about cats", "the quick brown fox jumps over",
               "streaming tokens arrive one by one"]
CORPUS = ("the quick brown fox jumps over the lazy dog. hello world, how are you today? once upon a time "
          "there was a little model that served many adapters at once. tell me a story about cats and dogs.")
CHATS = [
    [{"role": "system", "content": "you are a model"}, {"role": "user", "content": "tell me a story"}],
    [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "how are you today?"},
     {"role": "user", "content": "the quick brown fox"}],
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from multilora.engine.engine import Engine
    from multilora.server.app import build_app
    from multilora.server.async_engine import AsyncEngine

    root = tmp_path_factory.mktemp("lm_eval")
    model_dir = reference.make_tokenized_tiny_model(root / "model")
    end_often(model_dir)
    folders = {name: reference.make_adapter(model_dir, root / name, seed=31 + i, **reference.ADAPTER_SPECS[spec])
               for i, (name, spec) in enumerate(ADAPTERS.items())}
    # warmup=False: each step shape compiled when first asked for; the server's background
    # warm-up would compile every other shape beside the tests (twice this file's time)
    engine = Engine(str(model_dir), {n: str(p) for n, p in folders.items()}, max_loras_per_batch=2,
                    max_lora_rank=16, max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
                    max_model_len=MAX_MODEL_LEN, warmup=False)
    aengine = AsyncEngine(engine, max_queue=64)
    server, thread, url = serve_in_thread(build_app(aengine, api_key=API_KEY))
    yield Served(url=url, engine=engine, model_dir=model_dir,
                 ref=reference.PeftReference(model_dir, folders),
                 tok=AutoTokenizer.from_pretrained(str(model_dir)))
    server.should_exit = True
    thread.join(timeout=30)


def end_often(model_dir) -> None:
    """Make the EOS the greedy token wherever the model's most frequent greedy token over CORPUS
    was (its lm_head row: that token's, 2 % longer). A random model almost never picks the EOS;
    lm-eval's requests must be read right when it does (a loglikelihood's generated token, a
    generation's end, an empty generation)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))(CORPUS, add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        greedy = model(torch.tensor([ids])).logits[0].argmax(-1)
    twin = collections.Counter(greedy.tolist()).most_common(1)[0][0]
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    weights["lm_head.weight"][EOS] = weights["lm_head.weight"][twin] * 1.02
    save_file(weights, path, metadata={"format": "pt"})


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)   # what lm-eval's local-* clients send as the bearer token


def model_args(served, route: str, lora, **extra) -> str:
    """The `--model_args` string of `lm_eval --model local-completions` (or -chat-) for this server."""
    args = dict(model=lora or served.engine.model_name, base_url=f"{served.url}/v1/{route}", **extra)
    return ",".join(f"{k}={v}" for k, v in args.items())


def completions_lm(served, lora, **extra):
    cls = get_model("local-completions")
    return cls.create_from_arg_string(model_args(
        served, "completions", lora, tokenizer=served.model_dir, tokenizer_backend="huggingface",
        tokenized_requests=True, max_length=MAX_MODEL_LEN, **extra))


def spy(lm) -> list[tuple[int, dict]]:
    """(the number of prompts, the answer) of each request the (synchronous) client sends."""
    seen, call = [], lm.model_call

    def model_call(messages, **kw):
        out = call(messages=messages, **kw)
        seen.append((len(messages), out))
        return out
    lm.model_call = model_call
    return seen


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


# ---- the references --------------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def encode(served, text: str) -> list[int]:
    return served.tok(text, add_special_tokens=False).input_ids


def encode_pair(served, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's `hf` backend splits a pair: trailing spaces of
    the context go to the continuation; the whole is encoded and split at the context's length;
    an empty context is the prefix token (the EOS here: the tokenizer has no BOS)."""
    if not context:
        return [EOS], encode(served, continuation)
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = encode(served, context + continuation), encode(served, context)
    return ctx, whole[len(ctx):]


def ref_loglikelihood(served, lora, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """transformers + PEFT: log P(cont | ctx) and whether cont is the greedy continuation."""
    lp = log_softmax(served.ref.logits(lora, ctx + cont))[len(ctx) - 1:len(ctx) + len(cont) - 1]
    at = np.arange(len(cont))
    return float(lp[at, cont].sum()), bool((lp.argmax(-1) == cont).all())


def ref_greedy(served, lora, ids: list[int], max_new: int) -> list[int]:
    out = list(ids)
    for _ in range(max_new):
        out.append(int(served.ref.logits(lora, out)[-1].argmax()))
    return out[len(ids):]


def ref_text(served, lora, ids: list[int], max_new: int, stops: list[str]) -> tuple[str, str]:
    """The greedy text up to the EOS, and the same cut before the first stop string in it."""
    new = ref_greedy(served, lora, ids, max_new)
    if EOS in new:
        new = new[:new.index(EOS)]
    full = served.tok.decode(new, skip_special_tokens=True)
    cuts = [k for k in (full.find(s) for s in stops if s) if k >= 0]
    return full, full[:min(cuts)] if cuts else full


def special_pairs(served, lora) -> list[tuple[str, str]]:
    """The pairs lm-eval's reading of the answer hangs on: greedy continuations of one token and
    of three (is_greedy true), and a pair after which the reference's greedy token is the EOS
    (the generated token, which lm-eval leaves out of the sum, is then the EOS)."""
    out = []
    for context in ("the quick brown fox", "hello world", "tell me a story", "once upon a time"):
        ids = encode(served, context)
        g = ref_greedy(served, lora, ids, 3)
        for k in (1, 3):
            cont = served.tok.decode(g[:k])
            if EOS not in g[:k] and encode_pair(served, context, cont) == (ids, g[:k]) and len(out) < 2:
                out.append((context, cont))
    ids = encode(served, CORPUS)
    ends = np.flatnonzero(served.ref.logits(lora, ids).argmax(-1) == EOS)
    for p, q in ((p, q) for p in ends for q in range(p - 1, max(p - 4, 0), -1)):
        context, cont = served.tok.decode(ids[:q]), served.tok.decode(ids[q:p + 1])
        if encode_pair(served, context, cont) == (ids[:q], ids[q:p + 1]):
            out.append((context, cont))
            break
    assert len(out) == 3, f"the tiny model gave too few special pairs for {lora}: {out}"
    return out


# ---- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", [None, "all_r8"])
def test_loglikelihood_matches_transformers_and_peft(served, lora):
    """lm-eval's loglikelihood, four pairs to a request, and loglikelihood_rolling: the sums and
    is_greedy of transformers + PEFT, for the base model and an adapter."""
    pairs = LOGLIK_PAIRS + special_pairs(served, lora)
    lm = completions_lm(served, lora, batch_size=4)
    seen = spy(lm)
    got = lm.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    assert len(got) == len(pairs) and max(n for n, _ in seen) == 4   # several prompts in one request
    want = [ref_loglikelihood(served, lora, *encode_pair(served, c, x)) for c, x in pairs]
    dev = [abs(g[0] - w[0]) for g, w in zip(got, want)]
    print(f"loglikelihood, {lora or 'base'}: max |delta| {max(dev):.2e} nats")
    assert max(dev) < LOGLIK_ATOL, (dev, got, want)
    assert [g[1] for g in got] == [w[1] for w in want], (got, want)
    assert {w[1] for w in want} == {True, False}     # both answers are asked for
    # the generated token (the one lm-eval leaves out) was the EOS for the last special pair
    assert any(c["logprobs"]["tokens"][-1] == "<|im_end|>" and c["finish_reason"] == "stop"
               for _, out in seen for c in out["choices"])
    text = " ".join(c + x for c, x in LOGLIK_PAIRS[:2])
    rolling = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    want_rolling = ref_loglikelihood(served, lora, [EOS], encode(served, text))[0]
    assert abs(rolling[0] - want_rolling) < LOGLIK_ATOL, (rolling, want_rolling)


@pytest.mark.parametrize("lora", [None, "all_r8"])
def test_generate_until_on_completions_matches_the_greedy_decode(served, lora):
    """lm-eval's generate_until as token ids, three prompts to a request: the reference's greedy
    texts, each cut before the first of the stop strings (two of them drawn from the two longest
    texts, so that the cut happens); one text ends at the EOS."""
    fulls = [ref_text(served, lora, encode(served, p), MAX_GEN, [])[0] for p in GEN_PROMPTS]
    assert any(EOS in ref_greedy(served, lora, encode(served, p), MAX_GEN) for p in GEN_PROMPTS)  # one ends early
    stops = [f[3:5] for f in sorted(fulls, key=len)[-2:]]
    gen_kwargs = {"until": stops, "max_gen_toks": MAX_GEN, "do_sample": False}
    lm = completions_lm(served, lora, batch_size=3)
    seen = spy(lm)
    got = lm.generate_until(instances("generate_until", [(p, dict(gen_kwargs)) for p in GEN_PROMPTS]),
                            disable_tqdm=True)
    assert max(n for n, _ in seen) == 3
    want = [ref_text(served, lora, encode(served, p), MAX_GEN, stops + ["<|im_end|>"])[1] for p in GEN_PROMPTS]
    assert got == want
    assert sum(w != f for w, f in zip(want, fulls)) >= 2    # the stop strings did cut


@pytest.mark.parametrize("lora", [None, "attn_r4"])
def test_generate_until_on_chat_matches_the_greedy_decode(served, lora):
    """lm-eval's local-chat-completions (messages as JSON, the server's chat template; two at a
    time over aiohttp, its concurrent path): the reference's greedy text of the rendered prompt."""
    cls = get_model("local-chat-completions")
    lm = cls.create_from_arg_string(model_args(served, "chat/completions", lora, num_concurrent=2))
    prompts = [encode(served, served.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True))
               for m in CHATS]
    fulls = [ref_text(served, lora, ids, MAX_GEN, [])[0] for ids in prompts]
    until = [max(fulls, key=len)[2:4]]
    got = lm.generate_until(instances("generate_until", [
        (JsonChatStr(json.dumps(m)), {"until": until, "max_gen_toks": MAX_GEN}) for m in CHATS]), disable_tqdm=True)
    want = [ref_text(served, lora, ids, MAX_GEN, until)[1] for ids in prompts]
    assert got == want
    assert want != fulls    # the stop string did cut
