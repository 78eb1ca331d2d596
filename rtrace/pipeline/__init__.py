"""The pipeline: what happens to spans between the hot path and the sinks.

Span queue and processor bridge (``worker``), the open-trajectory registry
(``registry``), assembly into trajectories (``builder``), sampling (``sampling``),
annotations (``annotations``), token2text (``token2text``), conversations
(``messages``), the fan-out to sinks (``fanout``), and the collector that runs the same
assembly over spans arriving by OTLP from many processes (``collector``).

Imports flow one way: ``rtrace.instrumentation`` -> ``rtrace.pipeline`` ->
``rtrace.exporters``; nothing here imports the instrumentation.
"""
