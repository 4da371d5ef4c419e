# The compiled twin (Cython) of proto/resp_parser.py has exactly the API of the pure one:
# it is the same source compiled (setup.py). mypy and the tests see that one API.
from epistemic_kvcache.proto.resp_parser import RespParser as RespParser
