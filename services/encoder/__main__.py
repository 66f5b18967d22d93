from services.encoder.server import build
from services.runtime.server import main

main("encoder", build)
