"""`pagedq serve` caps request bodies by the bytes that arrive, not by what Content-Length says: 413 in OpenAI's
shape for a body past --max-body-bytes, sent with a Content-Length or chunked without one; /v1/files takes
--max-file-bytes instead, counted the same way. Real serve processes; no worker (nothing here runs a job)."""

import json

import httpx

from serve.body_limit import FORM_SLACK

CAP = 64 * 1024
KEY = "sk-body-limit-3a9d"


def oversized() -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 * CAP)}]}
    return json.dumps(body).encode()


def chunks(data: bytes, size: int = 8192):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def assert_too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert str(CAP) in err["message"]


def test_json_bodies_past_the_cap(queue, start_serve):
    base = start_serve(queue, "--model", "tiny", "--max-body-bytes", str(CAP))
    data = oversized()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches"):
        assert_too_large(httpx.post(f"{base}{path}", content=data, headers={"Content-Type": "application/json"}))
    # Chunked (httpx sends a generator so), no Content-Length: counted as it comes.
    r = httpx.post(f"{base}/v1/chat/completions", content=chunks(data), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert_too_large(r)
    # A body within the cap goes on to be read: here, to the 400 of its unknown field.
    r = httpx.post(f"{base}/v1/chat/completions", content=chunks(json.dumps({"model": "tiny", "bogus": 1}).encode()))
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus", r.text
    assert 'pagedq_serve_requests_total{route="/v1/chat/completions",status="413"} 2.0' in \
        httpx.get(f"{base}/metrics").text


def test_the_key_comes_before_the_size(queue, start_serve):
    base = start_serve(queue, "--model", "tiny", "--max-body-bytes", str(CAP), "--api-key", KEY)
    r = httpx.post(f"{base}/v1/chat/completions", content=oversized())
    assert r.status_code == 401, r.text
    r = httpx.post(f"{base}/v1/chat/completions", content=chunks(oversized()),
                   headers={"Authorization": f"Bearer {KEY}"})
    assert_too_large(r)


def multipart(text: bytes, boundary: str = "pagedq-test-boundary") -> bytes:
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + text + f"\r\n--{boundary}--\r\n".encode()


def test_files_take_their_own_cap(queue, start_serve):
    file_cap = 4 * CAP
    base = start_serve(queue, "--max-body-bytes", str(CAP), "--max-file-bytes", str(file_cap))
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "y" * 1000}}).encode() + b"\n"
    within = line * (2 * CAP // len(line))  # past the JSON routes' cap, within the files'
    r = httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", within)}, data={"purpose": "batch"})
    assert r.status_code == 200 and r.json()["bytes"] == len(within), r.text
    headers = {"Content-Type": "multipart/form-data; boundary=pagedq-test-boundary"}
    past = multipart(line * (8 * CAP // len(line)))
    r = httpx.post(f"{base}/v1/files", content=chunks(past), headers=headers)  # chunked: no Content-Length
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert str(file_cap + FORM_SLACK) in r.json()["error"]["message"]  # the file and its multipart framing
