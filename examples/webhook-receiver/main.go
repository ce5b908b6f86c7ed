// Command webhook-receiver serves the example Stripe receiver on :8080.
//
//	DATABASE_URL=postgres://... go run ./examples/webhook-receiver
//	curl -X POST localhost:8080/webhooks/stripe -d @event.json
package main

import (
	"context"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
	"github.com/idemkit/idem/migrate"

	"github.com/jackc/pgx/v5/stdlib"
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
	if err := receiver.Setup(ctx, pool); err != nil {
		log.Fatal(err)
	}
	rc := &receiver.Receiver{Pool: pool, Idem: idem.New(pool, nil), Mail: &receiver.StubMailer{}}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", rc)
	srv := &http.Server{Addr: ":8080", Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Printf("listening on %s", srv.Addr)
	if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		log.Fatal(err)
	}
}
