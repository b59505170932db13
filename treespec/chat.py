"""A conversation that keeps its K/V between turns.

    chat = treespec.Chat(model, tokenizer)         # drafter "auto", like `generate`
    print(chat.send("Write a haiku about the sea.").text)
    print(chat.send("Now one about the mountains.").text)

Each `send` renders the whole conversation through the tokenizer's chat template, as a fresh `generate` call
would, and decodes the reply with tree speculation. The decoder's cache still holds the K/V of every
earlier token (the history, the last reply), so the prefill runs only over the tokens the template adds
after them (`Decoder(reuse_prefix=True)`): a long conversation does not pay for its history again every
turn. Where the template renders the history differently from what was decoded (a reply whose text
tokenizes otherwise), the kept prefix ends there and the rest is prefilled. In float32 the reply is the one
a fresh call on the same conversation gives (greedy: the model's greedy reply); in int8 numerics the kept
K/V came from one-token steps, not from one prefill, which can change the int8 text.
`GenerationStats.prompt_reused` says how many prompt tokens a turn kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from .api import as_drafter
from .core.acceptance import SamplingConfig
from .core.cache import CacheCapacityError
from .core.decoder import Decoder
from .core.generate import DecodeOptions, GenerationResult, chat_ids, decode
from .core.stopping import StopCondition
from .core.tokens import eos_token_ids


class Chat:
    """A conversation with a chat model (a tokenizer with a chat template), decoded with tree speculation,
    its cache kept from turn to turn. `messages` holds the conversation ({"role", "content"} dicts)."""

    def __init__(
        self,
        model,
        tokenizer,
        drafter="auto",
        *,
        system: str | None = None,
        max_new_tokens: int = 256,
        sampling: SamplingConfig | None = None,
        stop: str | Sequence[str] | None = None,
        options: DecodeOptions | None = None,
    ):
        """drafter, sampling, stop, options: as `generate` takes them; system: a system message to start
        the conversation with (default: the template's own); max_new_tokens: per reply (`send` may
        override it)."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "Chat needs a tokenizer with a chat template (an instruct model's): for plain text "
                "continuation call treespec.generate(model, text, tokenizer=...) instead"
            )
        self.model, self.tokenizer, self.max_new_tokens, self.stop = model, tokenizer, max_new_tokens, stop
        self.options = options or DecodeOptions()
        self.decoder = Decoder(
            model,
            as_drafter(model, drafter, compile=self.options.compile, numerics=self.options.numerics),
            sampling=sampling,
            kernel=self.options.kernel,
            linears=self.options.linears,
            compile=self.options.compile,
            plain_above=self.options.plain_above,
            numerics=self.options.numerics,
            step=self.options.step,
            reuse_prefix=True,
            kv_dtype=self.options.kv_dtype,
        )
        self.eos = eos_token_ids(model, tokenizer)
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    def send(self, message: str, *, max_new_tokens: int | None = None, streamer=None) -> GenerationResult:
        """Add a user message, decode the assistant's reply (added to `messages`) and return it."""
        if not isinstance(message, str) or not message.strip():
            raise ValueError("send() takes the user's message as a non-empty string")
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        messages = [*self.messages, {"role": "user", "content": message}]
        ids = chat_ids(self.tokenizer, messages)
        stopping = [StopCondition(self.eos, self.stop, self.tokenizer, limit)]
        try:
            result = decode(self.decoder, [ids], stopping, [streamer], self.options.max_length)[0]
        except CacheCapacityError as error:
            raise CacheCapacityError(
                f"the conversation no longer fits the model ({error}): start a new one with chat.reset(), "
                "or send with a lower max_new_tokens"
            ) from error
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        return result

    def reset(self, system: str | None = None) -> None:
        """Start a new conversation (with `system`, default the one given at creation). The cache keeps
        what the new conversation shares with the old one (the template's opening, the system message)."""
        self.system = system if system is not None else self.system
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def close(self) -> None:
        """Free the cache (its pages serve the model's next cache); a later `send` makes a new one."""
        self.decoder.release()

    def __enter__(self) -> Chat:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
