from services.preprocess.server import build
from services.runtime.server import main

main("preprocess", build)
