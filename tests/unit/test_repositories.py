"""An LLM model's model.json read from a model repository, as the runner and the sidecar read it:
the newest version's, names that could leave the repository refused, and the JSON the sidecar
serves it as."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot_triton import repositories


def write_model_json(repository: Path, model: str, version: str, content: str) -> Path:
    directory = repository / model / version
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.json"
    path.write_text(content)
    return path


def test_the_model_json_is_read_from_the_newest_version(tmp_path: Path) -> None:
    for version, seqs in (("1", 8), ("3", 16), ("12", 32)):
        write_model_json(tmp_path, "llm", version, json.dumps({"model": "x", "max_num_seqs": seqs}))
    (tmp_path / "llm" / "20").mkdir()  # no model.json: not a version of the engine's
    found = repositories.read_repository_arguments(tmp_path, "llm")
    assert found == repositories.RepositoryArguments("12", {"model": "x", "max_num_seqs": 32})


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        ("absent", repositories.NotInRepository, "not in the model repository"),
        ("empty", repositories.NotInRepository, r"no model\.json in a version directory"),
        ("broken", repositories.RepositoryError, "cannot read"),
        ("listed", repositories.RepositoryError, "is not a JSON object"),
    ],
)
def test_a_model_the_repository_cannot_give_says_why(
    tmp_path: Path, model: str, error: type[Exception], message: str
) -> None:
    (tmp_path / "empty" / "1").mkdir(parents=True)
    write_model_json(tmp_path, "broken", "1", "{not json")
    write_model_json(tmp_path, "listed", "1", "[1, 2]")
    with pytest.raises(error, match=message):
        repositories.read_repository_arguments(tmp_path, model)


@pytest.mark.parametrize("model", ["..", ".", "", "../etc", "a/b", "/etc", ".hidden", "a\\b"])
def test_a_name_that_is_no_repository_directory_is_refused_before_any_path_is_built(
    tmp_path: Path, model: str
) -> None:
    write_model_json(tmp_path.parent, "etc", "1", "{}")
    with pytest.raises(repositories.InvalidModelName, match="is not a model name"):
        repositories.read_repository_arguments(tmp_path, model)


def test_a_model_json_linked_from_outside_the_repository_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "x"}')
    repository = tmp_path / "repository"
    (repository / "llm" / "1").mkdir(parents=True)
    (repository / "llm" / "1" / "model.json").symlink_to(secret)
    with pytest.raises(repositories.RepositoryError, match="leads out of the model repository"):
        repositories.read_repository_arguments(repository, "llm")


def test_the_served_document_parses_back_into_the_same_arguments() -> None:
    found = repositories.RepositoryArguments("2", {"model": "x", "max_num_seqs": 4})
    assert repositories.RepositoryArguments.from_json(found.to_json()) == found


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "not a JSON object"),
        ({"version": "../1", "arguments": {}}, "not a version directory's name"),
        ({"version": 1, "arguments": {}}, "not a version directory's name"),
        ({"version": "1", "arguments": "max_num_seqs=4"}, "are not a JSON object"),
    ],
)
def test_a_document_that_is_no_repository_arguments_is_refused(
    document: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        repositories.RepositoryArguments.from_json(document)


@pytest.mark.parametrize("odd", ["²", "١٢", "٣", "\uff11"])
def test_only_ascii_digits_name_a_version(tmp_path: Path, odd: str) -> None:
    # str.isdigit takes these: int() refuses '²' (an HTTP 500 in the sidecar) and reads '١٢'
    # as 12, which would have become the override key `file:١٢/model.json`.
    write_model_json(tmp_path, "llm", "1", json.dumps({"model": "x"}))
    write_model_json(tmp_path, "llm", odd, json.dumps({"model": "odd"}))
    found = repositories.read_repository_arguments(tmp_path, "llm")
    assert found == repositories.RepositoryArguments("1", {"model": "x"})
    with pytest.raises(ValueError, match="is not a version directory's name"):
        repositories.RepositoryArguments.from_json({"version": odd, "arguments": {}})


def test_a_version_keeps_its_directory_name(tmp_path: Path) -> None:
    write_model_json(tmp_path, "llm", "007", json.dumps({"model": "x"}))
    assert repositories.read_repository_arguments(tmp_path, "llm").version == "007"


def test_no_credential_of_a_model_json_is_served_wherever_it_sits() -> None:
    """Issue 39: secrets inside lists, names like aws_access_key_id, passwords in URLs."""
    secret = "AKIAsecretVALUE42"
    arguments = {
        "model": "/models/llm",
        "tokenizer": "/models/llm/tokenizer",
        "max_num_batched_tokens": 4096,
        "trust_remote_code": False,
        "aws_access_key_id": secret,
        "awsSecretAccessKey": secret,
        "extra_headers": [{"name": "x", "api_key": secret}, {"Authorization": f"Bearer {secret}"}],
        "hf_token": [secret],
        "download_url": f"https://user:{secret}@example.test/weights",
        "mirror": f"https://example.test/weights?sig={secret}&v=1",
        "mirrors": ["https://example.test/open", f"https://u:{secret}@example.test/closed"],
        "use_token": True,
        "auth_timeout": None,
    }
    served = repositories.without_credentials(repositories.RepositoryArguments("1", arguments))
    assert secret not in json.dumps(served.to_json()["arguments"])
    assert served.withheld == (
        "aws_access_key_id",
        "awsSecretAccessKey",
        "extra_headers[0].api_key",
        "extra_headers[1].Authorization",
        "hf_token",
        "download_url",
        "mirror",
        "mirrors[1]",
    )
    assert served.arguments["tokenizer"] == "/models/llm/tokenizer"
    assert served.arguments["mirrors"] == ["https://example.test/open"]
    assert served.arguments["use_token"] is True
