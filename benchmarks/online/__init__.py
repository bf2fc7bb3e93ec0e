"""The online serving benchmark's parts (benchmarks/online_bench.py is the command line):

workloads.py  what each workload sends (runs: rate, prompt counts, lengths), sized by a time budget
server.py     the OpenAI server as a subprocess: start, readiness, stop, its log, /metrics counters
client.py     vLLM's own `vllm bench serve`, run in this process once per run
multiturn.py  a small asyncio driver: conversations whose every turn resends the whole history
report.py     rows from the results, the SLO figure, the markdown tables, the plot, the summary
"""
