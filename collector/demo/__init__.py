"""The demo: scripted ShopBot traffic sent through the real OpenTelemetry SDK (``traffic``), and the same bot as a
function for ``tracejudge simulate`` (``shopbot``)."""
