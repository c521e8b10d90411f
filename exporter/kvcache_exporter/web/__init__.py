"""The HTTP endpoint: the aiohttp app, the bounded listener, basic auth and the web-config file."""
