"""The library's modules import one another without a circle, counting the imports
inside functions: each layer (`config`, `tasks/`, `agents/`, `rl/`, ...) imports only
from those below it. The import graph is the one `tools/gen_build.py` writes BUILD from.
"""

from tools import gen_build


def circles(graph):
  """One circle, as the nodes in import order, for each import that closes one when
  the graph `{node: [nodes it imports]}` is walked depth first."""
  found, state = [], {}  # state: "open" while on the walk's path, then "done".
  for start in graph:
    if start in state:
      continue
    path, todo = [start], [iter(graph[start])]
    state[start] = "open"
    while todo:
      nxt = next(todo[-1], None)
      if nxt is None:
        state[path.pop()] = "done"
        todo.pop()
      elif state.get(nxt) == "open":
        found.append(path[path.index(nxt):])
      elif nxt not in state:
        state[nxt] = "open"
        path.append(nxt)
        todo.append(iter(graph.get(nxt, ())))
  return found


def test_circles_are_found_and_named_in_order():
  assert circles({"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": []}) == [["a", "b", "c"]]
  assert circles({"a": ["b", "c"], "b": ["c"], "c": []}) == []
  assert circles({"a": ["a"]}) == [["a"]]


def test_the_library_has_no_import_circle():
  repo = gen_build.Repository()
  graph = {path: [p for p in repo.imported(path) if p in repo.library]
           for path in repo.library}
  named = [" -> ".join(gen_build._module_name(p) for p in circle + circle[:1])
           for circle in circles(graph)]
  assert not named, "import circles (imports inside functions count):\n" + "\n".join(named)
