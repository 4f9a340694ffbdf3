"""The command line: `multilora <command> --help` shows each option's default once."""

from __future__ import annotations

import re

import pytest

from multilora.cli import main


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


def _entries(text: str) -> dict[str, str]:
    """Option -> its help text, from the printed help (an entry starts at a line "  -x ...")."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current is not None and line.startswith("    "):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


@pytest.mark.parametrize("command", ["serve", "serve-ray", "generate"])
def test_help_shows_each_default_once(command, capsys):
    text = _help(command, capsys)
    assert "(default: None)" not in text and "(default: False)" not in text
    entries = _entries(text)
    assert "--max-num-seqs" in entries
    twice = {opt: t for opt, t in entries.items() if t.lower().count("default:") > 1}
    assert not twice
    assert "(default: 64)" in entries["--max-num-seqs"]


def test_every_lora_backend_is_a_choice(capsys):
    """--lora-backend offers each backend the engine has (the TPU's `pallas` too), and no other."""
    from multilora.lora.backend import BACKENDS
    text = _help("serve", capsys)
    listed = re.search(r"--lora-backend \{([\w,]+)\}", text).group(1).split(",")
    assert sorted(listed) == sorted(["auto", *BACKENDS])


def test_a_served_name_an_adapter_has_is_refused_before_the_model_loads(tmp_path):
    """`serve --served-model-name` clashing with a --lora-modules name ends the command with the
    reason before any model is read (the folder here does not even exist)."""
    missing = str(tmp_path / "no-model")
    with pytest.raises(SystemExit, match="'a' names both the base model and a LoRA adapter"):
        main(["serve", "--model", missing, "--lora-modules", f"a={missing}", "--served-model-name", "base", "a"])


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_launch_mistake_is_one_line_not_a_traceback(command, tmp_path, tiny_models):
    """A missing model or adapter folder ends the command with the reason (`error: ...`), before
    any server starts (tests/test_tensor_parallel.py: more devices than the host has)."""
    extra = ["--prompt", "hi"] if command == "generate" else []
    with pytest.raises(SystemExit, match=r"^error: no config.json in model folder .*no-model"):
        main([command, "--model", str(tmp_path / "no-model"), *extra])
    with pytest.raises(SystemExit, match=r"^error: LoRA adapter 'x': adapter folder .* does not exist"):
        main([command, "--model", str(tiny_models["llama"]), "--lora-modules", f"x={tmp_path / 'none'}", *extra])


def test_generate_prints_the_engines_tokens(tiny_models, tiny_adapters, tmp_path, capsys):
    """`multilora generate --json` over a tiny tokenized Llama and one of its adapters prints, per
    prompt, what Engine.generate gives for it (greedy), base and adapter rows in one run."""
    import json

    from multilora import Engine, SamplingParams
    from tests import reference
    model_dir, adapters = reference.tokenized_llama(tiny_models, tiny_adapters, tmp_path)
    prompts = ["hello world", "the cat sat"]
    tokens = {}
    for lora in (None, "a"):
        argv = ["generate", "--model", str(model_dir), "--lora-modules", f"a={adapters['a']}", "--json",
                "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--max-model-len", "128"]
        argv += [x for p in prompts for x in ("--prompt", p)] + (["--lora", lora] if lora else [])
        assert main(argv) == 0
        printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        eng = Engine(str(model_dir), {"a": str(adapters["a"])}, max_model_len=128, warmup=False)
        want = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), lora=lora)
        assert [p["token_ids"] for p in printed] == [o.token_ids for o in want], lora
        assert [p["lora"] for p in printed] == [lora, lora] and all(len(p["token_ids"]) == 6 for p in printed)
        tokens[lora] = [p["token_ids"] for p in printed]
    assert tokens[None] != tokens["a"]   # the adapter was applied


def test_lora_modules_take_vllms_json_form_too():
    from multilora.cli.args import parse_lora_modules
    got = parse_lora_modules(["a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}'])
    assert got == {"a": "/p/a", "b": "/p/b"}
    for item, words in (('{"name": "b"}', "JSON object with"), ('{"name": "b", "path": "/p", "x": 1}', "JSON object"),
                        ("{oops", "not valid JSON"), ("nopath", "name=path")):
        with pytest.raises(SystemExit, match=words):
            parse_lora_modules([item])
    with pytest.raises(SystemExit, match="names 'a' twice"):
        parse_lora_modules(["a=/p/a", '{"name": "a", "path": "/p/b"}'])


def test_a_vllm_command_line_parses_to_the_same_config():
    """vLLM's LoRA flags (--enable-lora, --max-loras, --max-cpu-loras) mean multilora's own."""
    import argparse

    from multilora.cli.args import engine_config_from_args
    from multilora.cli.serve import add_serve_args
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    vllm = engine_config_from_args(parse(["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "9",
                                          "--max-lora-rank", "32", "--served-model-name", "m"]))
    ours = engine_config_from_args(parse(["--max-loras-per-batch", "4", "--max-loaded-loras", "9",
                                          "--max-lora-rank", "32"]))
    assert vllm == ours and (ours.max_loras_per_batch, ours.max_loaded_loras) == (4, 9)


def test_chat_template_is_a_file_or_a_template_and_compiles(tmp_path):
    """--chat-template: a file's text, or the argument itself where it is a template; anything else,
    or a template that does not compile, ends the start naming it."""
    import argparse

    from multilora.cli.serve import chat_template_of
    t = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(t)
    assert chat_template_of(argparse.Namespace(chat_template=str(f))) == t
    assert chat_template_of(argparse.Namespace(chat_template=t)) == t
    assert chat_template_of(argparse.Namespace(chat_template=None)) is None
    with pytest.raises(SystemExit, match="neither a file nor a Jinja template"):
        chat_template_of(argparse.Namespace(chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(SystemExit, match="does not compile as Jinja"):
        chat_template_of(argparse.Namespace(chat_template="{% for m in messages %}{{ m }}"))


def test_generation_config_defaults_are_read_and_checked(tmp_path, caplog):
    """generation_config.json's sampling values (those it names; top_k 0 as off), a bad one left
    out with a warning; --generation-config takes auto, vllm or a folder holding one."""
    import json

    from multilora.server.service import check_generation_config
    from multilora.engine.build import generation_sampling_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "repetition_penalty": "x", "do_sample": True, "eos_token_id": 2}))
    assert generation_sampling_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": -1}
    assert "repetition_penalty='x' is not a valid default" in caplog.text
    assert generation_sampling_defaults(str(tmp_path / "none")) == {}
    for ok in ("auto", "vllm", str(tmp_path)):
        check_generation_config(ok)
    with pytest.raises(ValueError, match="expected auto, vllm or a folder"):
        check_generation_config(str(tmp_path / "none"))
    with pytest.raises(SystemExit, match="^error: --generation-config .*expected auto, vllm or a folder"):
        main(["serve", "--model", str(tmp_path / "no-model"), "--generation-config", str(tmp_path / "none")])
