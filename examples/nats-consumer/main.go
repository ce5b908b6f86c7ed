// Command nats-consumer books the transfers published on subject
// transfers.> ($SUBJECT) of JetStream stream TRANSFERS ($STREAM) exactly
// once, through the durable pull consumer "ledger" ($CONSUMER); both are
// created when missing. Each transfer is a JSON message
// {"id": "t-1", "account": "acct-1", "cents": 500}: its id is the
// idempotency key.
//
//	DATABASE_URL=postgres://... NATS_URL=nats://127.0.0.1:4222 go run ./examples/nats-consumer
package main

import (
	"context"
	"errors"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/nats-consumer/consumer"
	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if err := consumer.Setup(ctx, pool); err != nil {
		log.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	nc, err := nats.Connect(env("NATS_URL", nats.DefaultURL))
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Drain()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	stream, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:     env("STREAM", "TRANSFERS"),
		Subjects: []string{env("SUBJECT", "transfers.>")},
	})
	if err != nil {
		log.Fatal(err)
	}
	// AckWait is above the time a batch takes; a batch slower than that is
	// delivered again to another fetch, which finds the keys done (or
	// waits for the first transaction) and acks without booking twice.
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:       env("CONSUMER", "ledger"),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       30 * time.Second,
		MaxDeliver:    10,
		MaxAckPending: 1000,
	})
	if err != nil {
		log.Fatal(err)
	}
	cc := &consumer.Consumer{JS: cons, Pool: pool, Idem: c, BatchSize: 100}
	log.Printf("consuming %s/%s", stream.CachedInfo().Config.Name, cons.CachedInfo().Name)
	if err := cc.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
