"""Loading prompts: every source form, chat messages, length filtering and the error messages."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.data.loading import build_prompts, check_data_source, read_eval_rows, read_rows
from asyncgrpo.errors import ConfigError
from asyncgrpo.tasks import CHARSET, TASKS

pytestmark = pytest.mark.timeout(60)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A char-level tokenizer like the built-in tiny model's (no BOS added by default)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARSET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(""), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "say a: ", "answer": None}]


# -- sources ---------------------------------------------------------------------------------


def test_builtin_source():
    check_data_source("builtin:repeat_letter")
    rows = read_rows("builtin:addition", builtin_size=5, seed=2)
    assert rows == TASKS["addition"].rows(5, 2)
    assert read_eval_rows("builtin:addition", n=4, seed=2) == TASKS["addition"].eval_rows(4, 2)


def test_unknown_builtin_names_key_and_choices():
    with pytest.raises(ConfigError) as err:
        check_data_source("builtin:repeat_leter")
    msg = str(err.value)
    assert "data.source" in msg and "'builtin:repeat_leter'" in msg
    assert "did you mean builtin:repeat_letter" in msg and "builtin:addition" in msg


def test_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with path.open("a") as f:
        f.write("\n   \n")  # blank lines are skipped
    check_data_source(str(path))
    assert read_rows(str(path), builtin_size=1, seed=0) == ROWS
    assert read_eval_rows(str(path), n=1, seed=0) == ROWS[:1]


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b",\n')
    with pytest.raises(ConfigError) as err:
        read_rows(str(path), builtin_size=1, seed=0)
    msg = str(err.value)
    assert "data.source" in msg and str(path) in msg and "line 2" in msg and "Fix" in msg
    assert isinstance(err.value.__cause__, json.JSONDecodeError)

    path.write_text('{"prompt": "a"}\n["not", "an", "object"]\n')
    with pytest.raises(ConfigError, match="line 2 is a JSON list"):
        read_rows(str(path), builtin_size=1, seed=0, key="eval.source")


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    check_data_source(str(path))
    assert read_rows(str(path), builtin_size=1, seed=0) == ROWS

    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(ConfigError, match="cannot be read as Parquet"):
        read_rows(str(broken), builtin_size=1, seed=0)


def test_hf_dataset_dirs(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    check_data_source(str(single))
    assert read_rows(str(single), builtin_size=1, seed=0) == ROWS

    with_train = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(with_train))
    check_data_source(str(with_train))
    assert read_rows(str(with_train), builtin_size=1, seed=0) == ROWS

    no_train = tmp_path / "no_train"
    datasets.DatasetDict(
        {"validation": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(no_train))
    with pytest.raises(ConfigError) as err:
        check_data_source(str(no_train))
    msg = str(err.value)
    assert "data.source" in msg and "'train'" in msg and "validation" in msg and "test" in msg and "Fix" in msg


def test_missing_file_and_wrong_kinds(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_data_source(str(tmp_path / "nope.jsonl"), key="eval.source")
    msg = str(err.value)
    assert "eval.source" in msg and "nope.jsonl" in msg and "no such file" in msg and "Fix" in msg
    assert "builtin:repeat_letter" in msg

    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nx\n")
    with pytest.raises(ConfigError, match=r"unsupported file type '\.csv'.*\.jsonl"):
        check_data_source(str(csv))

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a saved Hugging Face dataset.*a.txt"):
        check_data_source(str(plain))

    with pytest.raises(ConfigError, match="data.source"):
        check_data_source("")


# -- building prompts ------------------------------------------------------------------------


def test_char_tokenizer_gives_sensible_ids(tok):
    prompts, report = build_prompts([{"prompt": "say a: "}], prompt_key="prompt", tokenizer=tok, max_prompt_tokens=64)
    ids = prompts[0].token_ids
    assert len(ids) == len("say a: ")  # one id per character, spaces kept, no BOS added by default
    assert tok.unk_token_id not in ids
    assert tok.decode(list(ids)) == "say a: "
    assert report.unknown_token_prompts == 0 and report.warnings() == []


def test_text_prompts_keep_columns_and_ids(tok):
    rows = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "1+1=", "answer": "2", "extra": [1, 2]}]
    prompts, report = build_prompts(rows, prompt_key="prompt", tokenizer=tok, max_prompt_tokens=64)
    assert [p.id for p in prompts] == [0, 1]
    assert prompts[0].text == "12+7=" and prompts[0].columns == {"answer": "19"}
    assert prompts[1].columns == {"answer": "2", "extra": [1, 2]}
    assert all(p.epoch == 0 and p.requeues == 0 for p in prompts)
    assert report.rows_read == 2 and report.kept == 2 and report.dropped == 0


def test_chat_messages_use_the_template(tok):
    rows = [{"messages": [{"role": "user", "content": "12+7="}], "answer": "19"}]
    prompts, report = build_prompts(rows, prompt_key="messages", tokenizer=tok, max_prompt_tokens=64)
    (p,) = prompts
    assert p.text == "<bos>user: 12+7=\nassistant: "
    assert p.token_ids[0] == tok.bos_token_id and p.token_ids.count(tok.bos_token_id) == 1  # no double BOS
    assert tok.unk_token_id not in p.token_ids
    assert p.columns == {"answer": "19"}
    assert report.chat


def test_chat_messages_without_template_name_the_key():
    bare = char_tokenizer(chat_template=None)
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(ConfigError) as err:
        build_prompts(rows, prompt_key="prompt", tokenizer=bare, max_prompt_tokens=64)
    msg = str(err.value)
    assert "data.prompt_key" in msg and "chat template" in msg and "Fix" in msg


def test_too_long_prompts_are_dropped_and_counted(tok):
    rows = [{"prompt": "a" * n} for n in (3, 10, 4, 20)]
    prompts, report = build_prompts(rows, prompt_key="prompt", tokenizer=tok, max_prompt_tokens=5)
    assert [p.id for p in prompts] == [0, 2]  # ids are row indices
    assert report.rows_read == 4 and report.kept == 2 and report.dropped_too_long == 2
    assert report.longest_dropped_tokens == 20 and report.longest_kept_tokens == 4
    assert "2 dropped as longer than data.max_prompt_tokens = 5" in report.summary()


def test_all_prompts_too_long_is_an_error(tok):
    with pytest.raises(ConfigError) as err:
        build_prompts([{"prompt": "a" * 30}], prompt_key="prompt", tokenizer=tok, max_prompt_tokens=5)
    msg = str(err.value)
    assert "no prompts left" in msg and "data.max_prompt_tokens = 5" in msg and "at least 30" in msg


def test_empty_prompts_are_dropped(tok):
    prompts, report = build_prompts(
        [{"prompt": ""}, {"prompt": "  "}, {"prompt": "x"}], prompt_key="prompt", tokenizer=tok, max_prompt_tokens=5
    )
    assert [p.id for p in prompts] == [2] and report.dropped_empty == 2
    with pytest.raises(ConfigError, match="empty"):
        build_prompts([{"prompt": ""}], prompt_key="prompt", tokenizer=tok, max_prompt_tokens=5)
    with pytest.raises(ConfigError, match="no rows"):
        build_prompts([], prompt_key="prompt", tokenizer=tok, max_prompt_tokens=5)


def test_missing_prompt_column_names_key_and_columns(tok):
    rows = [{"question": "12+7=", "answer": "19"}]
    with pytest.raises(ConfigError) as err:
        build_prompts(rows, prompt_key="prompt", tokenizer=tok, max_prompt_tokens=64)
    msg = str(err.value)
    assert "data.prompt_key = 'prompt'" in msg and "question, answer" in msg and "Fix" in msg


def test_prompt_column_of_the_wrong_type(tok):
    with pytest.raises(ConfigError, match=r"data.prompt_key = 'prompt': row 0 holds a int"):
        build_prompts([{"prompt": 7}], prompt_key="prompt", tokenizer=tok, max_prompt_tokens=64)


def test_unknown_characters_are_reported(tok):
    prompts, report = build_prompts([{"prompt": "Say A: "}], prompt_key="prompt", tokenizer=tok, max_prompt_tokens=64)
    assert report.unknown_token_prompts == 1
    assert "Say A" in report.warnings()[0]


def test_the_unknown_characters_are_named_counted_and_located_with_the_fix(tok):
    """builtin:tiny's tokenizer knows only its alphabet: the warning names each character it cannot encode, how often
    it occurs, the rows holding them, the alphabet and the fix."""
    rows = [{"prompt": "say a"}, {"prompt": "Say É\tnow"}, {"prompt": "ok"}, {"prompt": "SAY"}]
    _, report = build_prompts(rows, prompt_key="prompt", tokenizer=tok, max_prompt_tokens=64, source="data.source = d.jsonl")
    [warning] = report.warnings()
    assert report.unknown_chars == {"S": 2, "É": 1, "\t": 1, "A": 1, "Y": 1}
    assert "column 'prompt' of data.source = d.jsonl: 2 of 4 prompts (rows 1, 3)" in warning
    assert "5 distinct characters the tokenizer cannot encode (6 in all): 'S' x2, '\\t' x1, 'A' x1, 'Y' x1, 'É' x1" in warning
    assert "knows only lowercase a-z, digits 0-9, space, newline and +-*/=?:.,!'()" in warning
    assert "Fix: lower-case the text" in warning


def test_without_tokenizer(tok):
    rows = [{"prompt": "x" * 1000}, {"prompt": [{"role": "user", "content": "hi"}]}]
    prompts, report = build_prompts(rows, prompt_key="prompt", tokenizer=None, max_prompt_tokens=5)
    assert [p.token_ids for p in prompts] == [(), ()]
    assert prompts[1].text == "user: hi\n"
    assert report.kept == 2 and report.dropped_too_long == 0


def test_builtin_rows_tokenize_without_unknowns(tok):
    for name in TASKS:
        rows = read_rows(f"builtin:{name}", builtin_size=64, seed=0)
        prompts, report = build_prompts(rows, prompt_key="prompt", tokenizer=tok, max_prompt_tokens=256)
        assert report.kept == 64 and report.unknown_token_prompts == 0, name


def test_hub_name_gets_a_save_to_disk_hint():
    with pytest.raises(ConfigError, match=r"save_to_disk\('data/gsm8k'\)"):
        check_data_source("openai/gsm8k")
