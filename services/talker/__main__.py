from services.runtime.server import main
from services.talker.server import build

main("talker", build)
