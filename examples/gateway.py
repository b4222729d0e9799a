"""The gateway, as an example to read and run: `python -m examples.gateway --pool
baseline=URL --pool speculative=URL` (or `--config ace.toml`). It is `ace-mw gateway`
(`ace_mw/integrations/gateway.py`): AceSpecDec in front of a proxy that streams each request to
the pool its decision names."""

from ace_mw.integrations.gateway import main

if __name__ == "__main__":
    main()
