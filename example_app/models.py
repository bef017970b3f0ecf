"""The example's own tables: orders, and the audit trail the ``orders.audit`` handler writes."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, String, Text, Uuid, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    """An order. The queue message carries only its id; this row holds everything else."""

    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(200), index=True)
    email: Mapped[str] = mapped_column(String(320))
    amount_cents: Mapped[int]
    message_id: Mapped[uuid.UUID] = mapped_column(Uuid, unique=True)
    """The MessageID of the ``orders.created`` message published with this order."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    emailed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    email_attempts: Mapped[int] = mapped_column(default=0)
    email_error: Mapped[str | None] = mapped_column(Text)


class AuditEntry(Base):
    """One line of a customer's audit trail, written in publish order (an Ordered subscription)."""

    __tablename__ = "order_audit"

    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[uuid.UUID] = mapped_column(Uuid, unique=True)
    """The idempotency key: a redelivered message cannot add a second line."""
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"), index=True)
    customer: Mapped[str] = mapped_column(String(200), index=True)
    line: Mapped[str] = mapped_column(Text)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Customer(Base):
    """A customer who signed up; the ``customers.send-welcome-mail`` job stamps ``welcomed_at``."""

    __tablename__ = "customers"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    email: Mapped[str] = mapped_column(String(320))
    signed_up_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    welcome_job_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    """The id of the welcome-mail job dispatched with the sign-up (the same over its attempts)."""
    welcomed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
