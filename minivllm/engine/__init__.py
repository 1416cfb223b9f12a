"""The engine loop: requests in, tokens out.

`llm_engine` (LLMEngine, one step at a time) and `async_engine` (a stepping thread behind async streams)
drive `scheduler` (waiting / running, admission, chunked prefill, preemption, the `single_flight` gate),
`model_runner` (one batched forward and one evaluation per step) and `sampler`; `sequence` and
`sampling_params` hold a request's state and settings. It may import `minivllm.cache`, `minivllm.models`,
`minivllm.config`, `minivllm.outputs` (the results it gives back) and `kernels`; nothing here imports the entry points (`minivllm.llm`, `minivllm.cli`)
or `server`.
"""
