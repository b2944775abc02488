from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

from console.env import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
settings_load_or_exit()

application = get_wsgi_application()
