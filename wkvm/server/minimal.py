"""A minimal OpenAI-style completions server on the offline API (one request at a time).

The full server (streaming, chat, states, auth, metrics) is issue 5; this keeps `make serve` useful until then.
"""

from __future__ import annotations

import threading
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from wkvm.llm import LLM
from wkvm.sampling_params import InvalidParam, SamplingParams


class CompletionRequest(BaseModel):
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def create_app(llm: LLM, model_name: str) -> FastAPI:
    app = FastAPI(title="wkvm")
    lock = threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "wkvm"}]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        if req.model not in (None, model_name):
            return error(404, f"model {req.model!r} not found; this server serves {model_name!r}", "model")
        try:
            params = SamplingParams(
                max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                seed=req.seed, stop=req.stop or [], logprobs=req.logprobs,
            )  # fmt: skip
            prompt_ids = llm.encode_prompt(req.prompt)
        except InvalidParam as e:
            return error(400, str(e), e.param)
        except ValueError as e:
            return error(400, str(e), "prompt")
        with lock:
            out = llm.generate([prompt_ids], params)[0]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                      "total_tokens": len(prompt_ids) + len(out.token_ids)},
        }  # fmt: skip

    return app
