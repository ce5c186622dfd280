import csv

with open("/app/data.csv") as f:
    rows = list(csv.DictReader(f))
print(sum(int(r["amount"]) for r in rows[1:]))
