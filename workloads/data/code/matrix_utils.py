def transpose(matrix: list[list[float]]) -> list[list[float]]:
    return [list(row) for row in zip(*matrix, strict=True)]


def multiply(left: list[list[float]], right: list[list[float]]) -> list[list[float]]:
    columns = transpose(right)
    result = []
    for row in left:
        result.append([sum(a * b for a, b in zip(row, column, strict=True)) for column in columns])
    return result


def identity(size: int) -> list[list[float]]:
    return [[1.0 if row == column else 0.0 for column in range(size)] for row in range(size)]


def power(matrix: list[list[float]], exponent: int) -> list[list[float]]:
    result = identity(len(matrix))
    base = matrix
    while exponent > 0:
        if exponent % 2 == 1:
            result = multiply(result, base)
        base = multiply(base, base)
        exponent //= 2
    return result


def trace(matrix: list[list[float]]) -> float:
    return sum(matrix[index][index] for index in range(len(matrix)))
