"""POST /tokenize and /detokenize in vLLM's shapes: the token ids a completion prompt or a chat's messages become
(exactly what /v1/completions and /v1/chat/completions feed the model), and the text token ids decode to."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, params

from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError
from wkvm.server.generation import check_text, check_text_size
from wkvm.server.openai_routes import chat_messages, check_model, render_chat
from wkvm.server.schemas import DetokenizeRequest, TokenizeRequest
from wkvm.server.tools import tool_mode


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    r = APIRouter(dependencies=[auth])

    @r.post("/tokenize")
    def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.require_ready()
        check_model(ctx, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt (a completion's text) or messages (a chat's)", "prompt",
                           "invalid_value")  # fmt: skip
        if body.messages is not None:
            mode = tool_mode(body.tools, None, None)
            text = render_chat(ctx, chat_messages(body.messages), mode.tools if mode else None,
                               body.add_generation_prompt, body.continue_final_message)  # fmt: skip
        else:
            assert body.prompt is not None
            text = body.prompt
        param = "prompt" if body.messages is None else "messages"
        check_text(text, param)
        check_text_size(ctx, text, param)
        tok = ctx.tokenizer  # as a completion's prompt or a chat's messages are encoded (BOS: see encode_prompt)
        ids = tok.encode(text) if body.messages is not None else tok.encode_prompt(text)
        strs = [ctx.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.model.context_limit, "tokens": ids, "token_strs": strs}

    @r.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.require_ready()
        check_model(ctx, body.model)
        vocab = ctx.model.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary 0..{vocab - 1}", "tokens", "invalid_token")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    return r
