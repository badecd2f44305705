"""The three wire adapters (OpenAI Chat Completions, Anthropic Messages, OpenAI Responses):
a request decoded into the neutral conversation, an outcome encoded as the wire's reply."""
