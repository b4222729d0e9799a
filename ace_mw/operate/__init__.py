"""The operator's side: the status report, OpenTelemetry output, configuration reload and
the pools' probes.
"""
