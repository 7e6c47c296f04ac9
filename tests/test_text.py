"""Text in, text out (jax_dwdp/text.py): a tiny tokenizer made here with the `tokenizers` library, saved beside a
tiny random Qwen3.5-MoE checkpoint made with transformers (fp32):

- prompts of unequal lengths become the same ids as transformers' tokenizer gives; the chat template renders as
  transformers' apply_chat_template renders it; decode inverts encode;
- greedy tokens continuing from the prefill's caches with the reference decode step equal transformers' greedy
  `generate`, prompt by prompt, for the batch of unequal prompts on one device, over two pipeline stages and over
  two DWDP ranks;
- top-k: the most likely tokens and their probabilities, against a float64 softmax;
- bad prompt files and folders without a tokenizer are one clear error each.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HfTokenizer

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import Cache
from jax_dwdp.parallel import Pipeline
from jax_dwdp.prefill import jit_decode_step, jit_prefill
from jax_dwdp.generate import greedy, top_k
from jax_dwdp.text import CHATML, TextError, Tokenizer, read_prompt_file, write_small_tokenizer
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from tests.hf_reference import random_hf_model, save_hf

CFG = ModelConfig(vocab_size=320, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                  shared_expert_intermediate_size=24)
CORPUS = ["the quick brown fox jumps over the lazy dog", "a prefill reads the whole prompt at once",
          "experts live on every rank and move while the layer before computes", "hello world, how are you?"]
TEMPLATE = CHATML
PROMPTS = ["the quick brown fox", "hello world, how are you? a prefill reads the whole prompt", "experts move"]
NEW = 6


def write_tokenizer(folder) -> None:
    """The small byte-level tokenizer hf_export writes, trained on CORPUS, with a ChatML template."""
    write_small_tokenizer(folder, CFG.vocab_size, CORPUS)
    assert HfTokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() <= CFG.vocab_size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    seed = int(np.random.default_rng().integers(1 << 30))
    hf = random_hf_model(CFG, seed)
    save_hf(hf, folder / "ckpt")
    write_tokenizer(folder / "ckpt")
    return folder / "ckpt", hf


def test_prompts_become_transformers_ids_and_back(checkpoint):
    from transformers import PreTrainedTokenizerFast

    folder, _ = checkpoint
    tok = Tokenizer.from_checkpoint(folder)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=TEMPLATE)
    tokens, lengths = tok.batch(PROMPTS)
    assert tokens.dtype == np.int32 and tokens.shape == (3, lengths.max()) and len(set(lengths.tolist())) == 3
    for row, prompt in enumerate(PROMPTS):
        assert tokens[row, :lengths[row]].tolist() == ref(prompt)["input_ids"], prompt
        assert not tokens[row, lengths[row]:].any()
        assert tok.decode(tokens[row, :lengths[row]]) == prompt
        want = ref.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        assert tok.render_chat(prompt) == want
        assert tok.encode(prompt, chat=True) == ref.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)


def _hf_greedy(hf, prompt_ids) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.as_tensor([prompt_ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def _last(logits, lengths):
    return np.take_along_axis(np.asarray(logits, np.float32), (lengths - 1)[:, None, None], axis=1)[:, 0]


@pytest.mark.parametrize("layout", ["one device", pytest.param("2 stages", marks=pytest.mark.devices(2)),
                                    pytest.param("2 dwdp ranks", marks=pytest.mark.devices(2))])
def test_greedy_tokens_equal_transformers_generate(checkpoint, layout):
    folder, hf = checkpoint
    tok = Tokenizer.from_checkpoint(folder)
    tokens, lengths = tok.batch(PROMPTS)
    model, _ = load_hf_checkpoint(folder, dtype=jnp.float32)
    cache_len = tokens.shape[1] + NEW
    if layout == "one device":
        logits, cache = jit_prefill(model, cache_len=cache_len)(tokens, lengths)
    else:
        pipe = (Pipeline.from_model(model, 2) if layout == "2 stages" else
                Pipeline.from_model(model, 1, dwdp=2))
        # DWDP ranks split the batch: pad it to the ranks' multiple with a copy of the last row (dropped after)
        rows = tokens.shape[0] + (tokens.shape[0] % 2 if layout == "2 dwdp ranks" else 0)
        padded_tokens = np.concatenate([tokens, tokens[-1:]])[:rows]
        padded_lengths = np.concatenate([lengths, lengths[-1:]])[:rows]
        logits, caches = pipe.prefill(padded_tokens, padded_lengths, cache_len=cache_len)
        logits = np.asarray(logits)[:tokens.shape[0]]
        cache = jax.tree.map(lambda x: x[:, :tokens.shape[0]] if x.ndim > 1 else x[:tokens.shape[0]],
                             Cache.concat_layers(caches, jax.devices()[0]))
    got = greedy(jit_decode_step(model), _last(logits, lengths), cache, NEW)
    for row, prompt in enumerate(PROMPTS):
        want = _hf_greedy(hf, tokens[row, :lengths[row]].tolist())
        print(f"{layout}: {prompt!r} -> {tok.decode(got[row])!r} (transformers {tok.decode(want)!r})")
        assert got[row].tolist() == want, (layout, row)


def test_top_k_is_the_softmax_of_the_last_logits():
    rng = np.random.default_rng()
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 3
    out = top_k(logits, 5)
    z = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
    for b in range(3):
        ids = [i for i, _ in out[b]]
        assert ids == list(np.argsort(-probs[b])[:5])
        assert all(abs(p - probs[b, i]) <= 1e-12 for i, p in out[b])
        assert all(out[b][j][1] >= out[b][j + 1][1] for j in range(4))
    assert len(top_k(logits, 500)[0]) == 50


def test_prompt_files_and_missing_tokenizers_are_clear_errors(tmp_path, checkpoint):
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\n\nsecond one\n")
    assert read_prompt_file(lines) == ["first prompt", "second one"]
    listed = tmp_path / "prompts.json"
    listed.write_text(json.dumps(["a\nmulti-line prompt", "b"]))
    assert read_prompt_file(listed) == ["a\nmulti-line prompt", "b"]
    cases = [(tmp_path / "missing.txt", "no such file"), (tmp_path, "is not a regular file")]
    bad = tmp_path / "bad.json"
    bad.write_text('["unclosed"')
    cases.append((bad, "starts like a JSON list but is not JSON"))
    numbers = tmp_path / "numbers.json"
    numbers.write_text("[1, 2]")
    cases.append((numbers, "must be a list of strings"))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    cases.append((blank, "holds no prompt"))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    cases.append((binary, "is not UTF-8"))
    for path, message in cases:
        with pytest.raises(TextError, match=message):
            read_prompt_file(path)
    with pytest.raises(TextError, match="has no tokenizer.json"):
        Tokenizer.from_checkpoint(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TextError, match="is not a tokenizer the `tokenizers` library can read"):
        Tokenizer.from_checkpoint(broken)
    folder, _ = checkpoint
    tok = Tokenizer.from_checkpoint(folder)
    with pytest.raises(TextError, match="prompt 2: an empty prompt"):
        tok.batch(["fine", ""])
    tok.chat_template = None
    with pytest.raises(TextError, match="has no chat_template"):
        tok.render_chat("hi")


def _cli(capsys, *argv):
    from jax_dwdp.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("layout", [(), pytest.param(("--pipeline", "2"), marks=pytest.mark.devices(2)),
                                    pytest.param(("--dwdp", "2"), marks=pytest.mark.devices(2))],
                         ids=["one device", "2 stages", "2 dwdp ranks"])
def test_the_cli_takes_text_and_returns_transformers_tokens(checkpoint, capsys, tmp_path, layout):
    folder, hf = checkpoint
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[1:]))
    code, out, err = _cli(capsys, "prefill", "--checkpoint", str(folder), "--dtype", "float32", "--prompt", PROMPTS[0],
                          "--prompt-file", str(prompts), "--generate", str(NEW), "--top-k", "3", "--iters", "1",
                          "--json", *layout)
    assert code == 0, err
    text = json.loads(out)["text"]
    tok = Tokenizer.from_checkpoint(folder)
    assert [t["prompt"] for t in text] == PROMPTS
    for item in text:
        ids = tok.encode(item["prompt"])
        assert item["generated_ids"] == _hf_greedy(hf, ids), (layout, item["prompt"])
        assert item["generated_text"] == tok.decode(item["generated_ids"])
        assert item["next_tokens"][0]["id"] == item["generated_ids"][0] and len(item["next_tokens"]) == 3
        assert 1 >= item["next_tokens"][0]["p"] >= item["next_tokens"][1]["p"] >= item["next_tokens"][2]["p"] > 0


def test_the_cli_refuses_text_it_cannot_take(checkpoint, capsys, tmp_path):
    folder, _ = checkpoint
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    cases = [
        (("--preset", "tiny", "--prompt", "hi"), "--prompt needs --checkpoint DIR with the model's tokenizer.json"),
        (("--checkpoint", str(folder), "--prompt", "hi", "--batch", "2"), "the prompts are the batch"),
        (("--checkpoint", str(folder), "--chat"), "--chat renders --prompt / --prompt-file text"),
        (("--checkpoint", str(folder), "--prompt", "hi", "--generate", "2", "--prefill-chunk", "4"),
         "--generate continues one prefill's cache in one process"),
        (("--checkpoint", str(folder), "--prompt", "hi", "--top-k", "0"), "--top-k must be >= 1"),
        (("--checkpoint", str(bare), "--prompt", "hi"), "has no tokenizer.json"),
        (("--checkpoint", str(folder), "--prompt-file", str(tmp_path / "none.txt")), "none.txt: no such file"),
    ]
    for argv, message in cases:
        code, out, err = _cli(capsys, "prefill", "--dtype", "float32", "--iters", "1", *argv)
        assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
