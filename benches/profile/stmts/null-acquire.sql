SELECT $1, $2, $3
