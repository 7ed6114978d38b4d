"""vLLM's tokenizer endpoints on a real server (what lm-evaluation-harness's remote tokenizer
calls): /tokenize for a text and for a conversation, /detokenize, /tokenizer_info, and their
refusals."""

from __future__ import annotations

import pytest

from tests.server.conftest import AUTH, HTTP, MAX_MODEL_LEN, MESSAGES, post

TEXT = "Entropy is a measure of surprise. Ünïcödé, emoji 🎉 and   spaces\n"


def test_tokenize_gives_the_engines_ids_for_a_text(server, engine):
    tokenizer = engine.tokenizer
    reply = post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    assert reply["tokens"] == tokenizer.encode(TEXT)
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == MAX_MODEL_LEN
    assert reply["token_strs"] == [tokenizer.backend.id_to_token(t) for t in reply["tokens"]]
    bare = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert bare["token_strs"] is None


def test_tokenize_renders_a_conversation_as_chat_does(server, engine):
    reply = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert reply["tokens"] == engine.tokenizer.encode_chat(MESSAGES)
    open_turn = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert open_turn.json()["count"] < reply["count"]


def test_detokenize_gives_back_the_text(server):
    tokens = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    reply = post(server, "/detokenize", {"tokens": tokens["tokens"]})
    assert reply.status_code == 200 and reply.json() == {"prompt": TEXT}


def test_tokenizer_info_names_the_special_tokens_and_the_template(server, engine):
    reply = HTTP.get(f"{server.url}/tokenizer_info", headers=AUTH)
    info = reply.json()
    tokenizer = engine.tokenizer
    assert info["eos_token"] == tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["vocab_size"] == tokenizer.vocab_size


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, None),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
        ("/tokenize", {"prompt": "a", "echo": True}, "echo"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenizer_requests_are_a_400_naming_the_field(server, path, body, param):
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if param is not None:
        assert error["param"] == param
    if path == "/detokenize" and body["tokens"] != "abc":
        assert "outside the vocabulary" in error["message"]


def test_the_tokenizer_routes_need_the_api_key(server):
    for path in ("/tokenize", "/detokenize"):
        assert HTTP.post(f"{server.url}{path}", json={"prompt": "a"}).status_code == 401
    assert HTTP.get(f"{server.url}/tokenizer_info").status_code == 401
