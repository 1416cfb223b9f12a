"""What the engine refuses, decided once, here, before a request is admitted.

Every rule raises RequestError naming the request parameter it is about, in the engine's names
(`prompt`, `max_tokens`, `logit_bias`, `structured_output`); each protocol maps them to its own field
names and error shape. The server calls `check_context_length` early too, with a lower bound on the
prompt's tokens, to refuse a huge text before tokenizing it: the same rule, the same message.
"""


class RequestError(ValueError):
    """A request the engine refuses. param: the request parameter at fault; code: a machine-readable
    reason (e.g. context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, param, code)  # all in args: it pickles (Ray replicas send it back)
        self.message = message
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return self.message


def check_context_length(
    max_model_len: int, prompt_tokens: int, max_tokens: int | None, *, at_least: bool = False
) -> None:
    """The prompt and its completion (max_tokens, or at least one token) must fit the context.
    at_least: prompt_tokens is a lower bound (counted before tokenizing)."""
    needed = prompt_tokens + (max_tokens or 1)
    if needed <= max_model_len:
        return
    least = "at least " if at_least else ""
    prompt = f"{least}{prompt_tokens} in the prompt"
    asked = (
        f"{needed} tokens ({prompt}, {max_tokens} for the completion)"
        if max_tokens
        else f"{least}{prompt_tokens} tokens in the prompt and one for the completion"
    )
    raise RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {asked}.",
        param="max_tokens" if max_tokens and prompt_tokens < max_model_len else "prompt",
        code="context_length_exceeded",
    )


def check_prompt_ids(token_ids: list[int], vocab_size: int) -> None:
    if not token_ids:
        raise RequestError("prompt is empty", param="prompt")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")


def check_logit_bias(logit_bias: dict[int, float], vocab_size: int) -> None:
    bad = [t for t in logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"logit_bias: token ids must be in [0, {vocab_size}), got {bad[0]}", param="logit_bias"
        )


def check_request(
    token_ids: list[int],
    max_tokens: int | None,
    logit_bias: dict[int, float],
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Every rule a request's prompt and params must pass, decided without the engine's state (the server
    checks them before a stream's headers, the engine again when it takes the request)."""
    check_prompt_ids(token_ids, vocab_size)
    check_context_length(max_model_len, len(token_ids), max_tokens)
    check_logit_bias(logit_bias, vocab_size)
