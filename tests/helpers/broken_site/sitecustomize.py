"""Start-up hook of the broken-transport tests (see ``tests/helpers/broken_transport.py``)."""

import os

if os.environ.get("TENSORWIRE_TEST_BROKEN"):
    from tests.helpers.broken_transport import install

    install(os.environ["TENSORWIRE_TEST_BROKEN"])
