"""POST /tokenize and /detokenize in vLLM's shapes: the token ids a completion prompt or a chat's messages become
(exactly what /v1/completions and /v1/chat/completions feed the model), and the text token ids decode to. A request
naming the embedding model (or any request on an embeddings-only server) gets that model's: the ids /v1/embeddings
embeds for a text (its default prompt and special tokens included), as vLLM answers for a pooling model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, params

from wkvm.embeddings import EmbeddingModel
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError
from wkvm.server.generation import check_text, check_text_size
from wkvm.server.openai_routes import chat_messages, check_model, refuse_request_template, render_chat
from wkvm.server.schemas import DetokenizeRequest, TokenizeRequest
from wkvm.server.tools import tool_mode


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    r = APIRouter(dependencies=[auth])

    def embedder_asked(model: str | None) -> EmbeddingModel | None:
        """The embedding model, where the request names it or the server has no other (then checked as a name)."""
        e = ctx.embedder
        if e is not None and (not ctx.generative or (model == e.name and model != ctx.model_name)):
            ctx.require_ready(generative=False)
            if model not in (None, "", e.name):
                raise APIError(404, f"model {model!r} not found; this server serves {e.name!r}", "model",
                               "model_not_found")  # fmt: skip
            return e
        ctx.require_ready()
        check_model(ctx, model)
        return None

    @r.post("/tokenize")
    def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        embedder = embedder_asked(body.model)
        if embedder is not None:
            if body.messages is not None:
                raise APIError(400, "an embedding model takes a text (prompt), not chat messages", "messages",
                               "invalid_value")  # fmt: skip
            if body.prompt is None:  # it had said "not chat messages" where none were sent (hunt, session 47)
                raise APIError(400, "give prompt: the text to tokenize as the embedding model does", "prompt",
                               "invalid_value")  # fmt: skip
            check_text(body.prompt, "prompt")
            ids = embedder.token_ids(body.prompt)  # as /v1/embeddings tokenizes (bounded by --max-body-bytes)
            strs = [embedder.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": embedder.max_tokens, "tokens": ids, "token_strs": strs}
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt (a completion's text) or messages (a chat's)", "prompt",
                           "invalid_value")  # fmt: skip
        if body.messages is not None:
            refuse_request_template(body.chat_template)
            mode = tool_mode(body.tools, None, None)
            text = render_chat(ctx, chat_messages(body.messages), mode.tools if mode else None,
                               body.add_generation_prompt, body.continue_final_message,
                               ctx.template_variables(body.chat_template_kwargs))  # fmt: skip
        else:
            assert body.prompt is not None
            text = body.prompt
        param = "prompt" if body.messages is None else "messages"
        check_text(text, param)
        check_text_size(ctx, text, param)
        tok = ctx.tokenizer  # as a completion's prompt or a chat's messages are encoded (BOS: see encode_prompt)
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        ids = tok.encode_prompt(text) if special else tok.encode(text)
        strs = [ctx.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.model.context_limit, "tokens": ids, "token_strs": strs}

    @r.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        embedder = embedder_asked(body.model)
        vocab = embedder.vocab_size if embedder is not None else ctx.model.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary 0..{vocab - 1}", "tokens", "invalid_token")
        if embedder is not None:
            return {"prompt": embedder.tokenizer.decode(body.tokens)}
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    return r
