"""A small fake SGLang server for tests without a GPU: a real HTTP server in its own process.

It takes SGLang's launch options (those it does not know are ignored) and speaks the parts of SGLang's HTTP API
the SGLangEngine uses: GET /health (503 while "loading", then 200), GET /get_model_info and /model_info,
POST /generate with `input_ids`, streaming (SSE `data: {...}` events with cumulative `output_ids`, like SGLang's
default, then `data: [DONE]`) or not. Output token i is (last prompt token + i + 1) % vocab, so tests can check
the ids. With --speculative-algorithm it reports SGLang's spec fields (two tokens per verify step).

Environment knobs:
  FAKE_SGLANG_LOADING_S      seconds /health answers 503 after start (default 0.3)
  FAKE_SGLANG_CRASH_FILE     if set and the file does not exist: create it, and exit(3) in the middle of the
                             first /generate (so only the first launch crashes)
  FAKE_SGLANG_EXIT_AT_START  exit with this code right after printing a log line (a server that cannot start)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 2048
ACCEPT_PER_VERIFY = 2


def log(message: str) -> None:
    print(f"fake-sglang: {message}", flush=True)


class Handler(BaseHTTPRequestHandler):
    server_version = "fake-sglang"
    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes, like a chunked SSE body

    def log_message(self, fmt, *args):  # route access logs through stdout, as SGLang's uvicorn does
        log(fmt % args)

    def _json(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        state = self.server.state
        if self.path in ("/health", "/health_generate"):
            ready = time.monotonic() - state["started"] >= state["loading_s"]
            self.send_response(200 if ready else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path in ("/get_model_info", "/model_info"):
            self._json(200, {"model_path": state["args"].model_path, "is_generation": True, "fake": True})
        else:
            self._json(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        if self.path != "/generate":
            self._json(404, {"error": f"no route {self.path}"})
            return
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        args = self.server.state["args"]
        input_ids = request.get("input_ids")
        if not input_ids:
            self._json(400, {"error": {"message": "input_ids required", "type": "invalid_request_error"}})
            return
        sampling = request.get("sampling_params", {})
        max_new_tokens = int(sampling.get("max_new_tokens", 16))
        stop_ids = set(sampling.get("stop_token_ids") or [])
        output = []
        for i in range(max_new_tokens):
            output.append((input_ids[-1] + i + 1) % VOCAB)
            if output[-1] in stop_ids:
                break
        reason = "stop" if output[-1] in stop_ids else "length"
        speculative = bool(args.speculative_algorithm)
        step = ACCEPT_PER_VERIFY if speculative else 1
        crash_file = os.environ.get("FAKE_SGLANG_CRASH_FILE")
        crash_now = bool(crash_file) and not os.path.exists(crash_file)

        def meta(count: int, finished: bool) -> dict:
            info = {
                "id": "fake",
                "prompt_tokens": len(input_ids),
                "completion_tokens": count,
                "cached_tokens": 0,
                "finish_reason": {"type": reason} if finished else None,
            }
            if speculative:
                verify_ct = -(-count // ACCEPT_PER_VERIFY)
                info.update(
                    spec_verify_ct=verify_ct,
                    spec_accept_length=count / verify_ct if verify_ct else 0.0,
                    spec_num_correct_drafts=count - verify_ct,
                )
            return info

        def text(ids: list[int]) -> str:
            return "".join(f" t{t}" for t in ids)

        log(f"generate: {len(input_ids)} prompt tokens, {len(output)} output tokens, stream={request.get('stream')}")
        if not request.get("stream"):
            self._json(200, {"text": text(output), "output_ids": output, "meta_info": meta(len(output), True)})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for end in range(step, len(output) + step, step):
            end = min(end, len(output))
            event = {"text": text(output[:end]), "output_ids": output[:end], "meta_info": meta(end, end == len(output))}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()
            if crash_now and end >= 2:
                open(crash_file, "w").close()
                log("crashing on purpose (FAKE_SGLANG_CRASH_FILE)")
                os._exit(3)
            time.sleep(0.002)
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--speculative-algorithm", default=None)
    args, unknown = parser.parse_known_args()
    log(f"starting for {args.model_path} on {args.host}:{args.port} (ignored options: {' '.join(unknown)})")
    exit_code = os.environ.get("FAKE_SGLANG_EXIT_AT_START")
    if exit_code:
        log("cannot start (FAKE_SGLANG_EXIT_AT_START)")
        return int(exit_code)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.state = {"args": args, "started": time.monotonic(), "loading_s": float(os.environ.get("FAKE_SGLANG_LOADING_S", "0.3"))}
    log("The server is fired up and ready to roll!")
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
