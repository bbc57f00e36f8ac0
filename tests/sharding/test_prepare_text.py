"""jobs.prepare format=text: documents -> one `tokens` sample each, EOS last, the tokenizer in the
manifest's attributes (and its tokenizer.json in the dataset), on real text files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jobs.prepare import prepare
from jobs.text_corpus import token_dtype
from orchestrator.config import ConfigError, PrepareConfig
from sharding import DatasetError, open_dataset, verify
from sharding.format import MANIFEST_NAME

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _config(input_path: Path, output: Path, **kwargs: object) -> PrepareConfig:
    return PrepareConfig(input=str(input_path), output=str(output), **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[Path]]:
    """Real text from the standard library, nested, in a directory; returned in sorted path order."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    shutil.copy(STDLIB / "this.py", root / "z_this.py")
    shutil.copy(STDLIB / "abc.py", root / "b" / "abc.py")
    shutil.copy(STDLIB / "keyword.py", root / "a_keyword.py")
    (root / ".hidden").write_bytes(b"\xff not text, and skipped: hidden")
    return root, [root / "a_keyword.py", root / "b" / "abc.py", root / "z_this.py"]


def _tokens(path: Path) -> list[np.ndarray]:
    ds = open_dataset(path)
    return [ds.sample(i)["tokens"] for i in range(len(ds))]


def _no_temp_left(parent: Path) -> bool:
    return not any(p.name.startswith(".") for p in parent.iterdir())


def test_bytes_tokenizer_round_trips_a_directory_of_real_text(corpus, tmp_path):
    root, files = corpus
    prepare(_config(root, tmp_path / "out", format="text"))
    tokens = _tokens(tmp_path / "out")
    assert len(tokens) == len(files)
    for t, f in zip(tokens, files, strict=True):
        assert t.dtype == np.uint16 and t[-1] == 256 and 256 not in t[:-1]
        assert t[:-1].astype(np.uint8).tobytes().decode("utf-8") == f.read_text()
    ds = open_dataset(tmp_path / "out")
    assert dict(ds.attributes) == ds.manifest.attributes == {
        "tokenizer": {"kind": "bytes", "vocab_size": 257, "eos_id": 256, "file": None},
        "num_documents": 3, "num_tokens": sum(len(t) for t in tokens), "max_token_id": 256}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        MANIFEST_NAME, "shard-00000.bin", "shard-00000.idx"]
    assert verify(tmp_path / "out") == []


def test_jsonl_is_one_document_per_line_and_txt_one_per_file(tmp_path):
    lines = ["first document", "zweites Dokument: größer", "третий 😀"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": k}) + "\n" + ("\n" if k == 0 else "")
                             for k, t in enumerate(lines)))
    prepare(_config(jsonl, tmp_path / "out"))  # format=auto: a .jsonl file is text
    decoded = [t[:-1].astype(np.uint8).tobytes().decode() for t in _tokens(tmp_path / "out")]
    assert decoded == lines  # the blank line is no document
    txt = tmp_path / "one.txt"
    txt.write_text("line one\nline two\n")
    prepare(_config(txt, tmp_path / "out_txt"))
    assert [t[:-1].tobytes() for t in _tokens(tmp_path / "out_txt")] == [
        np.frombuffer(b"line one\nline two\n", np.uint8).astype(np.uint16).tobytes()]


def test_a_file_that_is_not_utf8_is_refused_by_name_and_nothing_is_published(corpus, tmp_path):
    root, _ = corpus
    (root / "b" / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.txt: not UTF-8 text.*skip_bad=true"):
        prepare(_config(root, tmp_path / "out", format="text"))
    assert not (tmp_path / "out").exists() and _no_temp_left(tmp_path)


def test_skip_bad_skips_and_counts_documents_that_are_not_utf8(corpus, tmp_path):
    root, files = corpus
    (root / "b" / "latin1.txt").write_bytes("café".encode("latin-1"))
    jsonl = root / "c.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"no_text": 1}\n')
    result = prepare(_config(root, tmp_path / "out", format="text", skip_bad=True))
    assert "skipped 3 bad document(s)" in result.note and "latin1.txt" in result.note
    assert "skip_bad=true), the first" in result.note and "skip such" not in result.note
    assert "skipped 3" in str(result)
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == ds.attributes["num_documents"] == len(files) + 1  # + jsonl's "ok"


def test_a_bad_jsonl_line_is_refused_by_file_and_line(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "ok"}\n\n{"text": 3}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl line 3: expected a JSON object with a string "
                                           r"\"text\" field; fix the line, or skip such"):
        prepare(_config(tmp_path / "d.jsonl", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_skip_bad_is_printed_by_the_command(corpus, tmp_path):
    root, _ = corpus
    (root / "bad.txt").write_bytes(b"\xff\xfe")
    proc = subprocess.run([sys.executable, "-m", "jobs.prepare", f"input={root}",
                           f"output={tmp_path / 'out'}", "format=text", "skip_bad=true"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3 samples" in proc.stdout and "skipped 1 bad document(s)" in proc.stdout
    assert "bad.txt" in proc.stdout


def test_bpe_trained_on_the_corpus_is_stored_in_the_dataset_and_decodes_it(corpus, tmp_path):
    root, files = corpus
    prepare(_config(root, tmp_path / "out", format="text", tokenizer="bpe", tokenizer_vocab=300))
    ds = open_dataset(tmp_path / "out")
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert ds.attributes["tokenizer"] == {"kind": "bpe", "vocab_size": 300, "eos_id": eos,
                                          "file": "tokenizer.json"}
    for t, f in zip(_tokens(tmp_path / "out"), files, strict=True):
        assert t.dtype == np.uint16 and t[-1] == eos and eos not in t[:-1]
        assert t.max() < 300 and len(t) < len(f.read_bytes())  # merges learned: fewer tokens
        assert tokenizer.decode(t[:-1].tolist()) == f.read_text()
    assert [f.name for f in ds.manifest.files] == ["tokenizer.json"]
    assert verify(tmp_path / "out") == []


def _word_tokenizer(path: Path, num_words: int, eos: str = "</s>") -> Path:
    """A word-level tokenizer.json with `num_words` words, [UNK] and `eos`."""
    vocab = {f"w{k}": k for k in range(num_words)} | {"[UNK]": num_words, eos: num_words + 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([eos])
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_json_given_by_path_is_used_and_copied(tmp_path):
    tok_path = _word_tokenizer(tmp_path / "my-tokenizer.json", 100)
    (tmp_path / "docs.jsonl").write_text('{"text": "w1 w2 w99"}\n{"text": "w5 </s> nope"}\n')
    prepare(_config(tmp_path / "docs.jsonl", tmp_path / "out", tokenizer=str(tok_path)))
    tokens = _tokens(tmp_path / "out")
    assert tokens[0].tolist() == [1, 2, 99, 101]  # EOS </s> found by its usual name
    # "</s>" spelled inside a document is text, not an end: only the appended EOS ends it
    assert tokens[1].tolist()[-1] == 101 and tokens[1].tolist().count(101) == 1
    assert tokens[0].dtype == np.uint16
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    assert open_dataset(tmp_path / "out").attributes["tokenizer"] == {
        "kind": "huggingface", "vocab_size": 102, "eos_id": 101, "file": "tokenizer.json"}


def test_a_tokenizer_without_a_known_eos_names_its_tokens_and_the_key(tmp_path):
    tok_path = _word_tokenizer(tmp_path / "t.json", 10, eos="<END>")
    (tmp_path / "a.txt").write_text("w1")
    with pytest.raises(ConfigError, match=r"none of the usual EOS tokens.*'<END>'.*'eos_token=\"<END>\"'"):
        prepare(_config(tmp_path / "a.txt", tmp_path / "out", tokenizer=str(tok_path)))
    prepare(_config(tmp_path / "a.txt", tmp_path / "out", tokenizer=str(tok_path),
                    eos_token="<END>"))
    assert _tokens(tmp_path / "out")[0].tolist() == [1, 11]


def test_a_tokenizer_path_that_is_not_a_tokenizer_is_refused_before_output(tmp_path):
    (tmp_path / "a.txt").write_text("w1")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"tokenizer=.*bad.json.*cannot be loaded"):
        prepare(_config(tmp_path / "a.txt", tmp_path / "out", tokenizer=str(tmp_path / "bad.json")))
    assert not (tmp_path / "out").exists()


def test_token_dtype_is_uint16_while_the_vocabulary_fits_else_uint32():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(2**32) == np.uint32
    with pytest.raises(ConfigError, match="does not fit uint32"):
        token_dtype(2**32 + 1)


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    tok_path = _word_tokenizer(tmp_path / "big.json", 70_000)
    (tmp_path / "a.txt").write_text("w0 w69999 w65536")
    prepare(_config(tmp_path / "a.txt", tmp_path / "out", tokenizer=str(tok_path)))
    (tokens,) = _tokens(tmp_path / "out")
    assert tokens.dtype == np.uint32 and tokens.tolist() == [0, 69999, 65536, 70001]


def test_overwrite_replaces_a_text_dataset_with_its_tokenizer_but_not_a_users_file(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "out"
    prepare(_config(root, out, format="text", tokenizer="bpe", tokenizer_vocab=280))
    prepare(_config(root, out, format="text", tokenizer="bpe", tokenizer_vocab=300, overwrite=True))
    assert open_dataset(out).attributes["tokenizer"]["vocab_size"] == 300
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match=r"not part of its dataset: 'notes.txt'"):
        prepare(_config(root, out, format="text", overwrite=True))
    assert (out / "notes.txt").read_text() == "mine" and (out / "tokenizer.json").is_file()


def test_verify_catches_a_changed_or_missing_tokenizer_json(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "out"
    prepare(_config(root, out, format="text", tokenizer="bpe", tokenizer_vocab=280))
    path = out / "tokenizer.json"
    original = path.read_bytes()
    path.write_bytes(original.replace(b'"<|endoftext|>"', b'"<|endoftexT|>"', 1))  # same size
    (problem,) = verify(out)
    assert problem.file == str(path) and "checksum" in problem.what
    path.write_bytes(original + b" ")
    (problem,) = verify(out)
    assert f"is {len(original) + 1} bytes, the manifest says {len(original)}" in problem.what
    path.unlink()
    (problem,) = verify(out)
    assert problem.file == str(path) and "missing" in problem.what


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tokenizer_vocab": 300}, r"tokenizer_vocab=300 is invalid: is only read by tokenizer=bpe"),
    ({"tokenizer": "bpe", "tokenizer_vocab": 100}, r"tokenizer_vocab=100 is invalid: must be >= 257"),
    ({"eos_token": "</s>"}, r"eos_token='</s>' is invalid: is only read with a tokenizer.json"),
    ({"tokenizer": ""}, r"tokenizer='' is invalid"),
])
def test_tokenizer_keys_that_nothing_would_read_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PrepareConfig(input="a", output="b", **kwargs)  # type: ignore[arg-type]


def test_text_keys_on_another_input_are_refused(tmp_path):
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "a.npy", np.zeros(3))
    for key, value in (("tokenizer", "bpe"), ("skip_bad", True)):
        with pytest.raises(ConfigError, match=f"{key}=.* is only read for text inputs.*npy_dir"):
            prepare(_config(tmp_path / "npy", tmp_path / "out", **{key: value}))


def test_a_directory_is_text_only_when_asked(corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(ConfigError, match=r"without .npy files.*format=text"):
        prepare(_config(root, tmp_path / "out"))



def test_the_text_keys_compose_from_the_command_line():
    from hydra import compose, initialize_config_module

    from jobs.prepare import to_config

    with initialize_config_module(config_module="conf", version_base="1.3"):
        config = to_config(compose("prepare", overrides=[
            "input=c", "output=o", "tokenizer=bpe", "tokenizer_vocab=500", "skip_bad=true"]))
        assert (config.tokenizer, config.tokenizer_vocab, config.skip_bad) == ("bpe", 500, True)
        config = to_config(compose("prepare", overrides=[
            "input=c", "output=o", "tokenizer=t/tokenizer.json", 'eos_token="</s>"',
            "labels=l.npy"]))
        assert (config.eos_token, config.labels) == ("</s>", "l.npy")
