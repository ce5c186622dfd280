"""Project configuration: settings, URLs, ASGI/WSGI entry points and the Celery app.

Named ``config`` rather than ``platform``: a top-level package called ``platform`` shadows
the standard-library module that ``uuid`` imports, and Django then fails to start.
"""
