from collections import deque


def shortest_path(graph: dict[str, list[str]], start: str, goal: str) -> list[str] | None:
    previous: dict[str, str | None] = {start: None}
    frontier = deque([start])
    while frontier:
        node = frontier.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = previous[node]
            return path[::-1]
        for neighbour in graph.get(node, []):
            if neighbour not in previous:
                previous[neighbour] = node
                frontier.append(neighbour)
    return None


def connected_components(graph: dict[str, list[str]]) -> list[set[str]]:
    seen: set[str] = set()
    components = []
    for node in graph:
        if node in seen:
            continue
        component = set()
        stack = [node]
        while stack:
            current = stack.pop()
            if current in component:
                continue
            component.add(current)
            stack.extend(graph.get(current, []))
        seen |= component
        components.append(component)
    return components
