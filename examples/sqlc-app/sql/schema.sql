-- The application's own table (its migrations would create it).
CREATE TABLE orders (
    order_id    text PRIMARY KEY,
    customer    text NOT NULL,
    total_cents integer NOT NULL
);
