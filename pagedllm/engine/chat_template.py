"""Chat templates, rendered by transformers in jinja2's ImmutableSandboxedEnvironment: a template (the model's,
or one a server operator passed with --chat-template) cannot reach Python internals or mutate its inputs."""

from __future__ import annotations

from typing import Any

from jinja2.exceptions import SecurityError, TemplateError

_RESERVED = {"messages", "tokenize", "chat_template", "add_generation_prompt", "continue_final_message",
             "return_dict", "tools", "documents"}


def render_chat_template(tokenizer: Any, messages: list[dict], *, chat_template: str | None = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         chat_template_kwargs: dict[str, Any] | None = None,
                         tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of a conversation. Raises ValueError naming what is wrong."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("messages: the model has no chat template (pass one with --chat-template)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message: the last message must be the assistant's")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED & extra.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs: may not set {clash}")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **extra)
    except SecurityError as e:
        raise ValueError(f"messages: the chat template was refused by the sandbox (it reached for Python "
                         f"internals): {e}") from e
    except TemplateError as e:
        raise ValueError(f"messages: chat template failed: {e}") from e
