"""Crucible's inference server: an OpenAI-compatible HTTP API over a policy checkpoint.

Serves a Hugging Face checkpoint directory (e.g. `<run>/final` or `<run>/step-000040/hf`
written by the RL engine) so `verifiers`, the data-synthesis generators and evaluation can call
"our inference" like any OpenAI endpoint: `POST /v1/chat/completions`, `POST /v1/completions`
(n, temperature, top_p, max_tokens, stop, seed, logprobs, stream, logit_bias; tools in the
Hermes / Qwen format, see `workers.envs.toolcalls`; response_format json_object /
json_schema by constrained decoding, see `workers.inference.grammar`), `GET /v1/models`, with
token usage. Sampling is the RL engine's own: for the Qwen3-MoE policies it trains, a continuous
scheduler over its lean forward (`workers.inference.continuous`: requests join and leave the
running batch between decode steps, prefix caching, chunked prefill); for any other model its
rollout path (`workers.rl.rollout.HFRollout`). See docs/serving.md.

Prompts for chat requests (`chat_format`, default "auto"): the format the checkpoint records in
`prompt_format.json` (written by the RL engine beside every model it saves: "raw", the plain
prompt text it trained on, so a lone user message `3+4=` is sent verbatim); without a record,
the tokenizer's chat template when it has one, else the plain format `<role>: <content>\\n` per
message followed by `assistant:`. "template", "plain" and "raw" force one.

From the command line:

    python -m workers.inference serve --model var/rl/checkpoints/final --port 8000

From a test (background thread, free port, stopped on exit):

    from workers.inference import start_server
    with start_server(model_dir, name="policy") as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused")
        client.chat.completions.create(model="policy", messages=[...], max_tokens=8)

`srv.url` is the OpenAI base URL (`http://127.0.0.1:<port>/v1`); `srv.model_name` the model id
to send (default: the directory's name).
"""

from workers.inference.server import RunningServer, build_app, start_server

__all__ = ["RunningServer", "build_app", "start_server"]
