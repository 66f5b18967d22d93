from services.runtime.server import main
from services.thinker.server import build

main("thinker", build)
